"""CUDA architecture lists as DeepSpeed 0.19's op builders can read them: DeepSpeed parses ``9.0a`` with
``int()`` and stops (``invalid literal for int() with base 10: '0a'``) before building FusedAdam; its ops use
no architecture-specific feature, so the plain architecture (``9.0``) serves.
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
    """While a DeepSpeed op builder reads its architectures: the environment's list, the builder's
    ``_jit_arch_list`` and ``cross_compile_archs`` without variant suffixes; the user's list is put back after
    unless DeepSpeed wrote its own."""
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
