"""Modules that exist only where CUDA does, served by stand-ins (``_sat_patches_boot``), and libraries that SAT
imports at ``import sat`` but a fine-tune never uses, imported when first used (``_sat_patches_deferred``), as
registry entries.

The start-up hook serves them while ``import sat`` (or CogVLM's model code) runs, before this package
may be imported at all; these records make them visible in ``sat-patches status``, turned off by
``SAT_PATCHES_DISABLE`` like any patch, and served here if the hook is not installed.
"""
from __future__ import annotations

import _sat_patches_boot

from ..core.module_patches import DeferredImportsPatch, ServedModulePatch


PATCHES = [
    ServedModulePatch(
        "xformers_standin", "sys.modules:" + _sat_patches_boot.XFORMERS, make=None,
        answers="xformers ships CUDA wheels only; CogVLM's EVA2-CLIP attention calls "
                "xformers.ops.memory_efficient_attention: served from torch's scaled_dot_product_attention"),
    DeferredImportsPatch(
        "deferred_imports", "sys.meta_path:DeferringFinder", make=None,
        answers="each process importing SAT spends about 4 s importing wandb, datasets, transformers.activations "
                "(which pulls in torch.distributed.tensor) and requests, which a CogVLM fine-tune calls only on "
                "request: imported at their first use"),
]
