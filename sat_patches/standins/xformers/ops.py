"""``xformers.ops.memory_efficient_attention`` on ``torch.nn.functional.scaled_dot_product_attention``.

xformers takes ``[batch, tokens, heads, head_dim]``; SDPA takes ``[batch, heads, tokens, head_dim]``:
the stand-in transposes in and out, so callers see xformers' layout and result.
"""
from typing import Optional

import torch
import torch.nn.functional as F

__sat_patches__ = "xformers_standin"


def memory_efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attn_bias: Optional[torch.Tensor] = None, p: float = 0.0,
                               scale: Optional[float] = None, **unsupported) -> torch.Tensor:
    if unsupported:
        raise TypeError(f"sat_patches' xformers stand-in does not take {sorted(unsupported)}; "
                        f"install xformers for them")
    if attn_bias is not None and not isinstance(attn_bias, torch.Tensor):
        raise TypeError(f"sat_patches' xformers stand-in takes a tensor attn_bias, not {type(attn_bias).__name__}; "
                        f"install xformers for xformers' bias classes")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=p, scale=scale)
    return out.transpose(1, 2)
