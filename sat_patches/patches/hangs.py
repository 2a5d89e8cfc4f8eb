"""Hang dumps: a collective that does not complete within the collective timeout ends the run on
every rank with each rank's Python stacks, naming the SAT call it was blocked in, and a non-zero exit
status -- instead of waiting 30 minutes (gloo) or until someone kills the job, as stock SAT does.
Torch's own functions stay as they are; SAT's calls that run collectives are wrapped.

* ``SAT_PATCHES_COLLECTIVE_TIMEOUT`` (seconds) becomes the timeout of every process group SAT's
  ``initialize_distributed`` creates: gloo raises "Timed out" after it, NCCL's watchdog aborts.
  Unset, groups keep torch's default and the watchdog below uses that. Where NCCL can run, torch's NCCL
  flight recorder is turned on (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``; a
  value the user set is kept): a timed-out rank writes its last collectives.
* SAT's functions that run collectives (``initialize_distributed``, the parameter sync of
  ``setup_model_untrainable_params_and_optimizer``, ``train_step``, ``evaluate``, ``save_checkpoint``'s
  barriers, ``mpu.broadcast_data``, ``training_main``'s barrier) are recorded as "SAT's X" while they run.
  A collective in one failing with its group's timeout makes this rank print a header naming the SAT
  call, dump every thread's stack (``faulthandler``), post the event in the process group's store, and
  exit with status :data:`sat_patches.diagnostics.watchdog.EXIT_CODE`.
* Every rank's watchdog thread looks at the rank's threads every poll: a thread inside the same
  ``torch.distributed`` collective for longer than the timeout (a group created later with torch's
  30 min, ``send``/``recv``, which gloo does not time out) makes the same report. It also polls the
  store: when another rank posted, this rank dumps its own stacks (showing what it was doing instead: a
  rank stuck in preprocessing is named too) and exits with the same status.
* SIGTERM (torchrun sends it to the other ranks when one fails): faulthandler dumps every thread's stack
  at once, then the watchdog names the SAT call the rank waited in and exits 143.
* Backstops that need no Python: ``faulthandler.dump_traceback_later`` (exits at timeout + grace after
  a collective of the main thread began), and ``faulthandler.enable()`` so NCCL's abort (SIGABRT) prints
  stacks.

CUDA collectives with NCCL return before they complete; there NCCL's watchdog enforces the timeout
and the SIGABRT dump and flight recorder apply (not exercised on this project's CPU-only CI).
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, expect_names
from ..diagnostics.watchdog import enable_nccl_flight_recorder, in_sat_call, start_watchdog


def _watched(name: str):
    """A SAT function that runs collectives, recorded as "SAT's ``name``" while it runs; its collectives'
    timeouts end the run on every rank (:func:`sat_patches.diagnostics.watchdog.in_sat_call`)."""
    def make(original):
        @functools.wraps(original)
        def watched(*args, **kwargs):
            return in_sat_call(name, original, *args, **kwargs)
        return watched
    return make


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


PATCHES = [
    Patch("collective_timeout", "sat.arguments:initialize_distributed", _initialize_distributed,
          answers="NCCL timeouts and silent hangs: SAT_PATCHES_COLLECTIVE_TIMEOUT for every SAT process group, "
                  "a watchdog and faulthandler dumps on every rank",
          expect=expect_names("init_process_group")),
] + [
    Patch(name, target, _watched(target.rpartition(":")[2]),
          answers=f"stock SAT waits silently when the {collective} in {target.rpartition(':')[2]} ({what}) "
                  f"blocks (30 min with gloo): now it names the SAT call and ends the run on every rank",
          expect=expect_names(collective))
    for name, (target, collective, what) in WATCHED.items()
]
