"""Data preprocessing on rank 0 first, the other ranks waiting behind a barrier with a timeout.

SAT's ``training_main`` runs ``make_loaders`` (the user's ``create_dataset_function``, where users preprocess and
cache) on every rank at once: early ranks wait in the next NCCL collective until its watchdog aborts them, and a
rank that raises leaves the others waiting, told nothing. Here rank 0 runs it first while the others wait in a
``monitored_barrier`` of a dedicated gloo group (``SAT_PATCHES_PREPROCESS_TIMEOUT``, default 7200 s; not timed by
the hang watchdog); then they run it, or raise naming rank 0's error (:mod:`sat_patches.runtime.preprocess`).
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, expect_names
from ..runtime.preprocess import rank0_first


def _make_loaders(original):
    """SAT's make_loaders (every rank at once in stock SAT), run on rank 0 first."""
    @functools.wraps(original)
    def make_loaders(*args, **kwargs):
        return rank0_first(functools.partial(original, *args, **kwargs))
    return make_loaders


PATCHES = [
    Patch("preprocess_rank0_first", "sat.data_utils.configure_data:make_loaders", _make_loaders,
          answers="stock SAT: make_loaders ran on every rank at once, so ranks done early hit the NCCL watchdog "
                  "while one preprocessed and a rank crashing in preprocessing left the others hanging; rank 0 now "
                  "goes first behind a gloo barrier (SAT_PATCHES_PREPROCESS_TIMEOUT) and its failure is reported",
          expect=expect_names("make_dataset_full", "make_data_loader")),
]
