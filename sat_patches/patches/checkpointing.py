"""Atomic checkpoint saves (:func:`sat_patches.checkpoints.saving.save_checkpoint_staged`): a rank killed during a
save leaves the previous checkpoint loadable; adapter-only saves of LoRA runs
(:func:`sat_patches.checkpoints.saving.save_adapter_only`).
"""
from __future__ import annotations

from ..checkpoints.saving import save_adapter_only, save_checkpoint_staged
from ..core.registry import Patch, delegate, expect_names


PATCHES = [
    Patch("save_adapter_only", "sat.training.model_io:save_ds_checkpoint_no_optim", delegate(save_adapter_only),
          answers="THUDM/CogVLM#303, THUDM/CogVideo#244: every save of a LoRA run holds the whole model; now its "
                  "adapters and a manifest naming the base",
          expect=expect_names("_save_checkpoint")),
    Patch("atomic_checkpoint_save", "sat.training.model_io:save_checkpoint", delegate(save_checkpoint_staged),
          answers="THUDM/CogVLM#283, #320 (ranks killed with kill -9): a rank killed mid-save left 'latest' "
                  "naming an iteration with missing/truncated MP shards; saves are now staged and renamed",
          expect=expect_names("save_ds_checkpoint", "get_checkpoint_tracker_filename", "barrier")),
]
