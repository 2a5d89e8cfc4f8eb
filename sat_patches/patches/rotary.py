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

import _sat_patches_boot

from ..core.registry import Patch
from .rotary_kernel import apply_rotary

TRITON_ROTARY = _sat_patches_boot.TRITON_ROTARY


class RotaryModulePatch(Patch):
    """Provide ``sat.model.position_embedding.triton_rotary`` without triton (import-time patch).

    Usually the start-up hook (``_sat_patches_boot``) has already served it while ``sat`` was
    imported; otherwise it is placed in ``sys.modules`` here, before sat_patches imports ``sat``.
    """

    def current(self):
        return sys.modules.get(TRITON_ROTARY)

    def is_applied(self) -> bool:
        return getattr(self.current(), "__sat_patches__", None) == self.name

    def apply(self, force: bool = False) -> None:
        if self.is_applied():
            self.status, self.reason = "applied", ""
            return
        if not _sat_patches_boot.wanted():
            self.status, self.reason = "not needed", "triton is installed"
            return
        if self.current() is not None:  # only reachable when triton imported fine before
            self.status, self.reason = "not needed", "SAT's triton module is already imported"
            return
        spec = _sat_patches_boot.kernel_spec()
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[TRITON_ROTARY] = self.replacement = module
        self.status, self.reason = "applied", ""

    def restore(self) -> None:
        if self.status == "applied" and self.current() is not None and self.is_applied():
            del sys.modules[TRITON_ROTARY]
            parent = sys.modules.get(TRITON_ROTARY.rpartition(".")[0])
            if parent is not None and hasattr(parent, "triton_rotary"):
                delattr(parent, "triton_rotary")
            self.replacement = None
            self.status, self.reason = "restored", ""


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
