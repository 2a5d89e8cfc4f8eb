"""Adapter-only saves of LoRA runs (:func:`sat_patches.checkpoints.saving.save_adapter_only`)."""
from __future__ import annotations

from ..checkpoints.saving import save_adapter_only
from ..core.registry import Patch, delegate, expect_names


PATCHES = [
    Patch("save_adapter_only", "sat.training.model_io:save_ds_checkpoint_no_optim", delegate(save_adapter_only),
          answers="THUDM/CogVLM#303, THUDM/CogVideo#244: every save of a LoRA run holds the whole model; now its "
                  "adapters and a manifest naming the base",
          expect=expect_names("_save_checkpoint")),
]
