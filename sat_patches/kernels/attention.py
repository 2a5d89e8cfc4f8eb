"""SAT's default attention, choosing its kernel without reading the mask in every layer.

SAT 0.4.12 compares the whole mask with a lower-triangular one and checks it for all-ones on every call (two host
syncs per layer). Here the mask's kind is read once per mask (:class:`~sat_patches.runtime.tensor_memo.TensorMemo`);
the choice and the call are SAT's.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from sat import mpu

from ..runtime.tensor_memo import TensorMemo


def read_mask_kind(mask: torch.Tensor) -> str:
    """``"full"`` (every position visible), ``"causal"`` (exactly lower-triangular) or ``"other"``, as SAT tells
    them apart (a ``[.., 1, n]`` mask of ones is both: full)."""
    if bool((mask > 0).all()):
        return "full"
    if bool((mask == torch.ones_like(mask, dtype=torch.float).tril()).all()):
        return "causal"
    return "other"


mask_kind = TensorMemo(read_mask_kind)


def _expand_heads(layer: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-query attention: each key/value head repeated over its group of query heads, contiguous, as SAT does
    (one head per query head: the same tensor, contiguous)."""
    batch, kv_heads = layer.shape[:2]
    if kv_heads == heads:
        return layer.contiguous()
    return layer.unsqueeze(2).expand(-1, -1, heads // kv_heads, -1, -1).contiguous().view(batch, heads, *layer.shape[2:])


def attention_fn(sat_attention_fn, query_layer, key_layer, value_layer, attention_mask, attention_dropout=None,
                 log_attention_weights=None, scaling_attention_score=True, **kwargs):
    """SAT's ``attention_fn_default`` (``sat_attention_fn``) with the mask's kind read once per mask. Masks that
    are neither full nor causal, and unscaled scores, go to SAT's own function."""
    if attention_mask is None or not scaling_attention_score or mask_kind(attention_mask) == "other":
        return sat_attention_fn(query_layer, key_layer, value_layer, attention_mask, attention_dropout,
                                log_attention_weights, scaling_attention_score, **kwargs)
    heads = query_layer.shape[1]
    key_layer, value_layer = _expand_heads(key_layer, heads), _expand_heads(value_layer, heads)
    dropout_p = 0.0 if attention_dropout is None or not attention_dropout.training else attention_dropout.p
    forked = dropout_p > 0 and mpu.get_cuda_rng_tracker is not None
    with mpu.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
        return F.scaled_dot_product_attention(query_layer, key_layer, value_layer, attn_mask=None,
                                              dropout_p=dropout_p, is_causal=mask_kind(attention_mask) == "causal")
