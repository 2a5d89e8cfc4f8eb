"""xformers, which ships CUDA wheels only, served by a stand-in where it is not installed (see
:mod:`sat_patches.core.import_hook`), as a registry entry."""
from __future__ import annotations

from ..core.import_hook import XFORMERS
from ..core.module_patches import ServedModulePatch

PATCHES = [
    ServedModulePatch(
        "xformers_standin", "sys.modules:" + XFORMERS, make=None,
        answers="xformers ships CUDA wheels only; CogVLM's EVA2-CLIP attention calls "
                "xformers.ops.memory_efficient_attention: served from torch's scaled_dot_product_attention"),
]
