"""Selective activation checkpointing beside SAT's full checkpoint (:mod:`sat_patches.runtime.checkpointing`)."""
from __future__ import annotations

from ..core.registry import Patch, delegate
from ..runtime.checkpointing import checkpoint_chunk, expect_layer_chunks

PATCHES = [
    Patch("selective_checkpoint", "sat.model.transformer:checkpoint", delegate(checkpoint_chunk),
          answers="a checkpointed layer runs its whole forward again in the backward pass, matrix products included "
                  "(SAT_PATCHES_CHECKPOINT_SELECTIVE: the share of layers that keep them)",
          expect=expect_layer_chunks),
]
