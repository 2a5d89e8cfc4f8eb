"""Hang dumps: a collective that does not complete within the collective timeout ends the run on
every rank with each rank's Python stacks, naming the SAT call it was blocked in, and a non-zero exit
status -- instead of waiting 30 minutes (gloo) or until someone kills the job, as stock SAT does.

* ``SAT_PATCHES_COLLECTIVE_TIMEOUT`` (seconds) becomes the timeout of every process group SAT's
  ``initialize_distributed`` creates (NCCL's own watchdog then aborts a stuck GPU collective).
  Unset, groups keep torch's default and the watchdog below uses that.
* Blocking ``torch.distributed`` collectives (barrier, broadcast, all_reduce, ...) are timed. A call
  still running after the timeout -- or raising gloo's "Timed out" -- makes this rank print a header
  naming the blocked SAT call, dump every thread's stack (``faulthandler``), post the event in the
  process group's store, and exit with status :data:`sat_patches.diagnostics.watchdog.EXIT_CODE`.
* Every rank's watchdog thread polls the store: when another rank posted a timeout, this rank dumps
  its own stacks (showing what it was doing instead: a rank stuck in preprocessing is named too) and
  exits with the same status.
* Backstops that need no Python: ``faulthandler.dump_traceback_later`` (exits at timeout + grace after
  the oldest collective still running on the main thread; armed when one starts, moved on and cancelled
  by the watchdog thread, so that a collective costs no thread of faulthandler's own), and
  ``faulthandler.enable()`` so NCCL's abort (SIGABRT) prints stacks.

CUDA collectives with NCCL return before they complete; there NCCL's watchdog enforces the timeout
and the SIGABRT dump applies (not exercised on this project's CPU-only CI).
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, expect_names
from ..diagnostics.watchdog import COLLECTIVES, start_watchdog, timed_collective


def _timed_collective(original):
    """A blocking torch.distributed collective, timed by this rank's watchdog once it runs."""
    @functools.wraps(original)
    def collective(*args, **kwargs):
        return timed_collective(original, *args, **kwargs)
    return collective


def _initialize_distributed(original):
    """SAT's process groups wait torch's default 30 min in a dead collective and say nothing."""
    @functools.wraps(original)
    def initialize_distributed(args):
        result = original(args)
        start_watchdog()
        return result
    return initialize_distributed


PATCHES = [
    Patch("collective_timeout", "sat.arguments:initialize_distributed", _initialize_distributed,
          answers="NCCL timeouts and silent hangs: SAT_PATCHES_COLLECTIVE_TIMEOUT for every SAT process group, "
                  "a watchdog and faulthandler dumps on every rank",
          expect=expect_names("init_process_group")),
] + [
    Patch(f"hang_watch_{name}", f"torch.distributed:{name}", _timed_collective,
          answers=f"stock SAT waits silently in a blocked {name} (30 min with gloo): now it names the SAT call "
                  f"and ends the run on every rank",
          verified_on="torch 2.13")
    for name in COLLECTIVES
]
