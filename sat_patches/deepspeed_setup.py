"""DeepSpeed set-up: configs DeepSpeed 0.19 rejects, and g++ builds it starts on CPU ranks."""
from __future__ import annotations

import functools
import warnings

from . import devices
from ._registry import Patch, SatPatchesWarning, expect_names


def lint_deepspeed_config(config: dict) -> dict:
    """Fix, with a warning, what a DeepSpeed config gets wrong in ways DeepSpeed cannot use.

    - ``fp16.min_loss_scale`` must be an integer (SAT's bundled configs say 0.01).
    - On a rank without CUDA, Adam/AdamW runs as ``torch.optim`` (``torch_adam``) instead of a
      FusedAdam/CPU-Adam that DeepSpeed compiles with g++ on first use (~45 s).
    """
    fp16 = config.get("fp16") or {}
    scale = fp16.get("min_loss_scale")
    if scale is not None and not isinstance(scale, int):
        fixed = max(1, int(scale))
        warnings.warn(f"DeepSpeed config: fp16.min_loss_scale={scale!r} is not an integer "
                      f"(DeepSpeed rejects it); using {fixed}", SatPatchesWarning, stacklevel=2)
        fp16["min_loss_scale"] = fixed
    optimizer = config.get("optimizer") or {}
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer")
    if (devices.compute_device().type != "cuda" and not offload
            and str(optimizer.get("type", "")).lower() in ("adam", "adamw")):
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    return config


def _lint_before_deepspeed(original):
    """SAT hands ``args.deepspeed_config`` to DeepSpeed first in ``initialize_distributed``."""
    @functools.wraps(original)
    def initialize_distributed(args):
        if isinstance(getattr(args, "deepspeed_config", None), dict):
            lint_deepspeed_config(args.deepspeed_config)
        return original(args)
    return initialize_distributed


def _build_shm_op(original):
    """deepspeed.comm.torch builds a shared-memory all-reduce op with g++ on CPU (~30 s)."""
    @functools.wraps(original)
    def build_shm_op():
        if devices.compute_device().type != "cuda":
            return None
        return original()
    return build_shm_op


PATCHES = [
    Patch("deepspeed_config_lint", "sat.arguments:initialize_distributed", _lint_before_deepspeed,
          answers="SAT's bundled configs: min_loss_scale 0.01 (DeepSpeed ValidationError); CPU FusedAdam build",
          expect=expect_names("deepspeed_config")),
    Patch("deepspeed_no_shm_build", "deepspeed.comm.torch:build_shm_op", _build_shm_op,
          answers="DeepSpeed JIT-compiles its ShareMemComm op with g++ on CPU ranks",
          verified_on="deepspeed 0.19.8",
          expect=expect_names("create_op_builder", "load")),
]
