"""Patch binding :mod:`sat_patches.kernels.attention` to SAT's ``attention_fn_default``."""
from __future__ import annotations

from ..core.registry import Patch, expect_names
from ..kernels.attention import attention_fn


def _attention_fn_default(original):
    """SAT's attention_fn_default compares the whole mask with a lower-triangular one in every layer (a host
    sync per layer and per recomputed layer) to choose torch's fused attention."""
    def attention_fn_default(query_layer, key_layer, value_layer, attention_mask, *args, **kwargs):
        return attention_fn(original, query_layer, key_layer, value_layer, attention_mask, *args, **kwargs)
    return attention_fn_default


PATCHES = [
    Patch("attention_mask_read_once", "sat.transformer_defaults:attention_fn_default", _attention_fn_default,
          answers="attention_fn_default reads the whole attention mask twice in every layer (host syncs)",
          expect=expect_names("scaled_dot_product_attention", "tril", "standard_attention")),
]
