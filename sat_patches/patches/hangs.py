"""Hang dumps: a collective that does not complete within the collective timeout ends the run on every rank
with each rank's Python stacks, naming the SAT call it was blocked in, and exit status 124, instead of waiting
30 minutes or until someone kills the job (:mod:`sat_patches.diagnostics.watchdog`).

``SAT_PATCHES_COLLECTIVE_TIMEOUT`` sets the timeout of the process groups SAT creates. SAT's ``make_loaders``
(data preprocessing) runs on rank 0 first, the others waiting behind a gloo barrier
(:mod:`sat_patches.runtime.preprocess`).
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, delegate, expect_names
from ..diagnostics.watchdog import enable_nccl_flight_recorder, in_sat_call, start_watchdog
from ..runtime.preprocess import rank0_first


def _watched(name: str):
    """A SAT function that runs collectives, recorded as "SAT's ``name``" while it runs (:func:`in_sat_call`)."""
    return delegate(functools.partial(in_sat_call, name))


def _initialize_distributed(original):
    """SAT's process groups wait torch's default 30 min in a dead collective and say nothing."""
    @functools.wraps(original)
    def initialize_distributed(args):
        enable_nccl_flight_recorder()   # read when the NCCL group is created
        result = in_sat_call("initialize_distributed", original, args)
        start_watchdog()
        return result
    return initialize_distributed


WATCHED = {  # patch name: (SAT function, a collective its code calls, what it does)
    "hang_watch_parameter_sync": ("sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer",
                                  "broadcast", "syncs the initialized parameters"),
    "hang_watch_train_step": ("sat.training.deepspeed_training:train_step", "all_reduce", "reduces the loss"),
    "hang_watch_evaluate": ("sat.training.deepspeed_training:evaluate", "all_gather", "gathers the metrics"),
    "hang_watch_save_checkpoint": ("sat.training.model_io:save_checkpoint", "barrier", "waits for every rank"),
    "hang_watch_broadcast_data": ("sat.mpu.data:broadcast_data", "broadcast", "broadcasts each batch"),
    "hang_watch_training_main": ("sat.training.deepspeed_training:training_main", "barrier",
                                 "waits for every rank after loading"),
}


def _make_loaders(original):
    """SAT's make_loaders (every rank at once in stock SAT), run on rank 0 first."""
    @functools.wraps(original)
    def make_loaders(*args, **kwargs):
        return rank0_first(functools.partial(original, *args, **kwargs))
    return make_loaders


PATCHES = [
    Patch("collective_timeout", "sat.arguments:initialize_distributed", _initialize_distributed,
          answers="NCCL timeouts and silent hangs: SAT_PATCHES_COLLECTIVE_TIMEOUT for every SAT process group, "
                  "a watchdog and faulthandler dumps on every rank",
          expect=expect_names("init_process_group")),
    Patch("preprocess_rank0_first", "sat.data_utils.configure_data:make_loaders", _make_loaders,
          answers="stock SAT: make_loaders ran on every rank at once, so ranks done early hit the NCCL watchdog "
                  "while one preprocessed and a rank crashing in preprocessing left the others hanging; rank 0 now "
                  "goes first behind a gloo barrier (SAT_PATCHES_PREPROCESS_TIMEOUT) and its failure is reported",
          expect=expect_names("make_dataset_full", "make_data_loader")),
] + [
    Patch(name, target, _watched(target.rpartition(":")[2]),
          answers=f"stock SAT waits silently when the {collective} in {target.rpartition(':')[2]} ({what}) "
                  f"blocks (30 min with gloo): now it names the SAT call and ends the run on every rank",
          expect=expect_names(collective))
    for name, (target, collective, what) in WATCHED.items()
]
