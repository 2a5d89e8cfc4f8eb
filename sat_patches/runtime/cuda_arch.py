"""CUDA architecture lists as DeepSpeed 0.19's op builders can read them.

PyTorch accepts architecture-specific targets in ``TORCH_CUDA_ARCH_LIST`` (``9.0a`` on Hopper, ``10.0a``,
``12.0f``), and images built for Hopper set them. DeepSpeed's ``CUDAOpBuilder.compute_capability_args`` sorts
the list with ``int()`` of each part and stops with ``ValueError: invalid literal for int() with base 10: '0a'``
before its FusedAdam (the optimizer of every CUDA ZeRO run) is built. Its ops use no architecture-specific
feature: built for the plain architecture (``9.0``), they run on the same card.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator, Optional

VARIANT = re.compile(r"\b(\d+)\.(\d+)[A-Za-z]+")
ARCH_LIST = "TORCH_CUDA_ARCH_LIST"


def without_variants(arch_list: Optional[str]) -> Optional[str]:
    """``"8.0;9.0a+PTX"`` -> ``"8.0;9.0+PTX"``; ``None`` and lists without a suffix are returned as given."""
    return VARIANT.sub(r"\1.\2", arch_list) if arch_list else arch_list


@contextlib.contextmanager
def plain_arch_list(builder, cross_compile_archs: Optional[str]) -> Iterator[Optional[str]]:
    """While a DeepSpeed op builder reads its architectures: ``TORCH_CUDA_ARCH_LIST``, the list ``jit_load``
    captured from it (``builder._jit_arch_list``) and ``cross_compile_archs`` without variant suffixes. The
    environment keeps what DeepSpeed writes into it (the list it builds for, kept in sync for PyTorch's own
    flags); the user's list is put back only where DeepSpeed wrote nothing."""
    given = os.environ.get(ARCH_LIST)
    plain = without_variants(given)
    if plain != given:
        os.environ[ARCH_LIST] = plain
    captured = getattr(builder, "_jit_arch_list", None)
    if captured:
        builder._jit_arch_list = without_variants(captured)
    try:
        yield without_variants(cross_compile_archs)
    finally:
        if plain != given and os.environ.get(ARCH_LIST) == plain:
            os.environ[ARCH_LIST] = given
