"""Adapter-only saves of LoRA runs (:func:`sat_patches.checkpoints.saving.save_adapter_only`).

* ``save_adapter_only`` -- ``sat.training.model_io.save_ds_checkpoint_no_optim`` has DeepSpeed write the
  whole model into every save (~35 GB for CogVLM at MP=1, THUDM/CogVLM#303), though a LoRA run trains
  megabytes of it. When :func:`~sat_patches.checkpoints.adapter.adapter_only` says so, DeepSpeed is asked
  for the trained parameters only (``exclude_frozen_parameters``), and ``adapter.json`` beside the shards
  names the base checkpoint the model was loaded from. Optimizer shards, learning-rate and random states
  are saved as before, so the run resumes from it exactly.
"""
from __future__ import annotations

from ..checkpoints.saving import save_adapter_only
from ..core.registry import Patch, delegate, expect_names


PATCHES = [
    Patch("save_adapter_only", "sat.training.model_io:save_ds_checkpoint_no_optim", delegate(save_adapter_only),
          answers="THUDM/CogVLM#303, THUDM/CogVideo#244: every save of a LoRA run holds the whole model; now its "
                  "adapters and a manifest naming the base",
          expect=expect_names("_save_checkpoint")),
]
