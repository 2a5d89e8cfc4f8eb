"""Atomic checkpoint saves (:func:`sat_patches.checkpoints.saving.save_checkpoint_staged`): a rank killed during a
save leaves the previous checkpoint loadable.
"""
from __future__ import annotations

from ..checkpoints.saving import save_checkpoint_staged
from ..core.registry import Patch, delegate, expect_names


PATCHES = [
    Patch("atomic_checkpoint_save", "sat.training.model_io:save_checkpoint", delegate(save_checkpoint_staged),
          answers="THUDM/CogVLM#283, #320 (ranks killed with kill -9): a rank killed mid-save left 'latest' "
                  "naming an iteration with missing/truncated MP shards; saves are now staged and renamed",
          expect=expect_names("save_ds_checkpoint", "get_checkpoint_tracker_filename", "barrier")),
]
