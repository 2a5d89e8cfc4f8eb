"""Pure-torch rotary kernel with the contract of SAT's triton ``apply_rotary``.

Standalone on purpose (torch only, no package-relative imports): the import hook
(:mod:`sat_patches.core.import_hook`) serves this file as ``sat.model.position_embedding.triton_rotary`` when
triton is missing, while ``sat`` itself is still being imported.
"""
from typing import Optional, Union

import torch

__sat_patches__ = "triton_rotary_import"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor,
                 seqlen_offsets: Union[int, torch.Tensor] = 0, cu_seqlens: Optional[torch.Tensor] = None,
                 max_seqlen: Optional[int] = None, interleaved: bool = False, inplace: bool = False,
                 conjugate: bool = False) -> torch.Tensor:
    """Same contract as SAT's triton ``apply_rotary``: x is (batch, nheads, seqlen, headdim),
    cos/sin are (seqlen_ro, rotary_dim/2) indexed by ``position_ids`` (batch, seqlen) plus offsets."""
    if cu_seqlens is not None:
        raise NotImplementedError("sat_patches rotary fallback: variable-length (cu_seqlens) input "
                                  "needs SAT's triton kernel on CUDA")
    batch, _, seqlen, headdim = x.shape
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > headdim:
        raise ValueError(f"rotary_dim {rotary_dim} must be <= headdim {headdim}")
    pos = position_ids.long()
    if isinstance(seqlen_offsets, torch.Tensor):
        pos = pos + seqlen_offsets.long().view(batch, 1)
    else:
        pos = pos + seqlen_offsets
    c = cos[pos].unsqueeze(1)  # (batch, 1, seqlen, half)
    s = sin[pos].unsqueeze(1)
    if conjugate:
        s = -s
    rot = x[..., :rotary_dim]
    if interleaved:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = rot[..., :half], rot[..., half:]
        out = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    out = out.to(x.dtype)
    if inplace:
        # like the triton kernel, write the memory without an autograd record (x is often a view
        # from split(); SAT's autograd.Function owns the gradient)
        x.data[..., :rotary_dim].copy_(out)
        return x
    if rotary_dim < headdim:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out


apply_rotary.__sat_patches_kernel__ = True
