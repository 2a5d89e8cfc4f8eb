"""SAT's attention path: ``attention_fn_default`` reading the mask's kind once per mask
(:mod:`sat_patches.kernels.attention`), a pure-torch rotary kernel for SAT's ``FastRotaryEmbedding`` where triton
or CUDA is missing, and xformers (CUDA wheels only) served by a stand-in where it is not installed
(:mod:`sat_patches.core.import_hook`).
SAT's ``triton_rotary`` imports ``triton`` at module level and runs only on CUDA; only that module is
substituted (a fake top-level ``triton`` would break ``torch._inductor``).
"""
from __future__ import annotations

import functools
import inspect

from ..core.import_hook import TRITON_ROTARY, XFORMERS
from ..core.module_patches import ServedModulePatch
from ..core.registry import Patch, delegate, expect_names
from ..kernels.attention import attention_fn
from ..kernels.rotary import apply_rotary


def _dispatching_apply_rotary(original):
    """Triton present but tensors not on CUDA: use the torch kernel."""
    triton_kernel = not getattr(original, "__sat_patches_kernel__", False)

    @functools.wraps(original)
    def dispatch(x, *args, **kwargs):
        if x.is_cuda and triton_kernel:
            return original(x, *args, **kwargs)
        return apply_rotary(x, *args, **kwargs)
    return dispatch


def _expect_rotary_signature(original):
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    want = ["x", "cos", "sin", "position_ids"]
    return None if params[:4] == want else f"its leading parameters are {params[:4]}, expected {want}"


PATCHES = [
    ServedModulePatch(
        "triton_rotary_import", "sys.modules:" + TRITON_ROTARY, make=None,
        answers="import sat fails without triton (sat/model/position_embedding/triton_rotary.py)"),
    Patch("rotary_torch_fallback", "sat.model.position_embedding.triton_rotary_embeddings:apply_rotary",
          _dispatching_apply_rotary,
          answers="FastRotaryEmbedding (LLaMA, CogVLM) runs a triton kernel with no CPU path",
          expect=_expect_rotary_signature),
    ServedModulePatch(
        "xformers_standin", "sys.modules:" + XFORMERS, make=None,
        answers="xformers ships CUDA wheels only; CogVLM's EVA2-CLIP attention calls "
                "xformers.ops.memory_efficient_attention: served from torch's scaled_dot_product_attention"),
    Patch("attention_mask_read_once", "sat.transformer_defaults:attention_fn_default", delegate(attention_fn),
          answers="attention_fn_default reads the whole attention mask twice in every layer (host syncs)",
          expect=expect_names("scaled_dot_product_attention", "tril", "standard_attention")),
]
