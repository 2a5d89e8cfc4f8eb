"""DeepSpeed set-up: configs DeepSpeed 0.19 rejects, g++ builds it starts on CPU ranks, CUDA architecture lists
its op builders cannot read."""
from __future__ import annotations

import functools

from ..core.registry import Patch, delegate, expect_names, expect_params
from ..runtime import devices
from ..runtime.cuda_arch import plain_arch_list
from ..runtime.deepspeed_config import initialize_distributed_linted


def _build_shm_op(original):
    """deepspeed.comm.torch builds a shared-memory all-reduce op with g++ on CPU (~30 s)."""
    @functools.wraps(original)
    def build_shm_op():
        if devices.compute_device().type != "cuda":
            return None
        return original()
    return build_shm_op


def _plain_arch_list(original):
    """DeepSpeed parses ``TORCH_CUDA_ARCH_LIST=9.0a`` with ``int()`` before FusedAdam's JIT build
    (deepspeedai/DeepSpeed#7589, #8619): its ops are built for the plain architecture instead."""
    @functools.wraps(original)
    def compute_capability_args(self, cross_compile_archs=None):
        with plain_arch_list(self, cross_compile_archs) as archs:
            return original(self, archs)
    return compute_capability_args


PATCHES = [
    Patch("deepspeed_config_lint", "sat.arguments:initialize_distributed", delegate(initialize_distributed_linted),
          answers="SAT's bundled configs: min_loss_scale 0.01 (DeepSpeed ValidationError); CPU FusedAdam build; "
                  "upstream test_config_bf16.json: top-level offload_optimizer ignored; batch-size arithmetic",
          expect=expect_names("deepspeed_config")),
    Patch("deepspeed_no_shm_build", "deepspeed.comm.torch:build_shm_op", _build_shm_op,
          answers="DeepSpeed JIT-compiles its ShareMemComm op with g++ on CPU ranks",
          verified_on="deepspeed 0.19.8",
          expect=expect_names("create_op_builder", "load")),
    Patch("deepspeed_arch_variants", "deepspeed.ops.op_builder.builder:CUDAOpBuilder.compute_capability_args",
          _plain_arch_list,
          answers="ValueError: invalid literal for int() with base 10: '0a' building FusedAdam with "
                  "TORCH_CUDA_ARCH_LIST=9.0a (deepspeedai/DeepSpeed#7589)",
          verified_on="deepspeed 0.19.8",
          expect=expect_params("cross_compile_archs")),
]
