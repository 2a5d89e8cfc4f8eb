"""DeepSpeed set-up: configs DeepSpeed 0.19 rejects, and g++ builds it starts on CPU ranks."""
from __future__ import annotations

import functools

from ..core.registry import Patch, expect_names
from ..runtime import devices
from ..runtime.deepspeed_config import initialize_distributed_linted


def _lint_before_deepspeed(original):
    """SAT hands ``args.deepspeed_config`` to DeepSpeed first in ``initialize_distributed``."""
    @functools.wraps(original)
    def initialize_distributed(*args, **kwargs):
        return initialize_distributed_linted(original, *args, **kwargs)
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
          answers="SAT's bundled configs: min_loss_scale 0.01 (DeepSpeed ValidationError); CPU FusedAdam build; "
                  "upstream test_config_bf16.json: top-level offload_optimizer ignored; batch-size arithmetic",
          expect=expect_names("deepspeed_config")),
    Patch("deepspeed_no_shm_build", "deepspeed.comm.torch:build_shm_op", _build_shm_op,
          answers="DeepSpeed JIT-compiles its ShareMemComm op with g++ on CPU ranks",
          verified_on="deepspeed 0.19.8",
          expect=expect_names("create_op_builder", "load")),
]
