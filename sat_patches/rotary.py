"""A pure-torch rotary kernel for SAT's ``FastRotaryEmbedding`` where triton or CUDA is missing.

SAT's ``sat/model/position_embedding/triton_rotary.py`` imports ``triton`` at module level, so
``import sat`` fails without it, and its kernel only runs on CUDA tensors. LLaMA, hence CogVLM's
language model, uses ``FastRotaryEmbedding``. Only SAT's own rotary module is substituted: a fake
top-level ``triton`` would break ``torch._inductor``.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import types
from typing import Optional, Union

import torch

from ._registry import Patch, expect_names

TRITON_ROTARY = "sat.model.position_embedding.triton_rotary"


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


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


class RotaryModulePatch(Patch):
    """Provide ``sat.model.position_embedding.triton_rotary`` without triton (import-time patch)."""

    def current(self):
        return sys.modules.get(TRITON_ROTARY)

    def apply(self, force: bool = False) -> None:
        present = sys.modules.get(TRITON_ROTARY)
        if getattr(present, "__sat_patches__", None) == self.name:
            self.status, self.reason = "applied", ""
            return
        if triton_importable():
            self.status, self.reason = "not needed", "triton is installed"
            return
        module = types.ModuleType(TRITON_ROTARY, __doc__)
        module.apply_rotary = apply_rotary
        module.__sat_patches__ = self.name
        self.original, self.replacement = present, module
        sys.modules[TRITON_ROTARY] = module
        parent = sys.modules.get(TRITON_ROTARY.rpartition(".")[0])
        if parent is not None:
            setattr(parent, "triton_rotary", module)
        self.status, self.reason = "applied", ""

    def restore(self) -> None:
        if self.status == "applied" and sys.modules.get(TRITON_ROTARY) is self.replacement:
            if self.original is None:
                del sys.modules[TRITON_ROTARY]
            else:
                sys.modules[TRITON_ROTARY] = self.original
            self.replacement = None
            self.status, self.reason = "restored", ""


def _dispatching_apply_rotary(original):
    """Triton present but tensors not on CUDA: use the torch kernel."""
    @functools.wraps(original)
    def dispatch(x, *args, **kwargs):
        if x.is_cuda and original is not apply_rotary:
            return original(x, *args, **kwargs)
        return apply_rotary(x, *args, **kwargs)
    return dispatch


def _expect_rotary_signature(original):
    import inspect
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    want = ["x", "cos", "sin", "position_ids"]
    return None if params[:4] == want else f"its leading parameters are {params[:4]}, expected {want}"


PATCHES = [
    RotaryModulePatch(
        "triton_rotary_import", "sys.modules:" + TRITON_ROTARY, make=None,
        answers="import sat fails without triton (sat/model/position_embedding/triton_rotary.py)"),
    Patch("rotary_torch_fallback", "sat.model.position_embedding.triton_rotary_embeddings:apply_rotary",
          _dispatching_apply_rotary,
          answers="FastRotaryEmbedding (LLaMA, CogVLM) runs a triton kernel with no CPU path",
          expect=_expect_rotary_signature),
]
