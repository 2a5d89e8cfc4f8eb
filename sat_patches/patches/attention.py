"""Patch binding :mod:`sat_patches.kernels.attention` to SAT's ``attention_fn_default``."""
from __future__ import annotations

from ..core.registry import Patch, delegate, expect_names
from ..kernels.attention import attention_fn


PATCHES = [
    Patch("attention_mask_read_once", "sat.transformer_defaults:attention_fn_default", delegate(attention_fn),
          answers="attention_fn_default reads the whole attention mask twice in every layer (host syncs)",
          expect=expect_names("scaled_dot_product_attention", "tril", "standard_attention")),
]
