"""A run's console says what changes; SAT's bulk diagnostics go into files of the run directory.

During ``training_main`` SwissArmyTransformer 0.4.12 prints, on rank 0, every argument (about 120
lines, ``print_args``), and per log interval a ``time (ms) | forward ... | backward ...`` line
(``Timers.log``) and, once, a CUDA memory line (``report_memory``) that reads all zeros on a CPU
rank. Between them the few lines a user watches (progress, validation, saves) are hard to find.
Here, when the run has a directory (``--save``, or ``SAT_PATCHES_LEDGER_DIR``):

* the arguments go to ``arguments.txt`` there and the console gets one line naming it;
* the interval's timer values go to ``step_times.csv`` there (iteration, then milliseconds per
  timer), not the console;
* the memory line is printed only where CUDA is present.

Without a run directory SAT prints as before. ``SAT_PATCHES_DISABLE`` with a patch's name
(``sat_console_to_files``, ``timers_to_step_times``, ``memory_report_cuda_only``) brings its lines back.
"""
from __future__ import annotations

import functools

import torch

from ..core.registry import Patch, delegate, expect_params
from ..diagnostics.console import log_timers_to_file, print_args_to_file


def _report_memory(original):
    @functools.wraps(original)
    def report_memory(name):
        if torch.cuda.is_available():
            return original(name)
    return report_memory


PATCHES = [
    Patch("sat_console_to_files", "sat.training.deepspeed_training:print_args", delegate(print_args_to_file),
          answers="SAT prints ~120 argument lines at the start of every run; here they go to arguments.txt in "
                  "the run directory and the console gets one line",
          expect=expect_params("args")),
    Patch("timers_to_step_times", "sat.training.utils:Timers.log", delegate(log_timers_to_file),
          answers="SAT prints a 'time (ms) | forward ...' line per log interval between the progress lines; here "
                  "the values go to step_times.csv in the run directory",
          expect=expect_params("self", "names", "normalizer", "reset")),
    Patch("memory_report_cuda_only", "sat.training.deepspeed_training:report_memory", _report_memory,
          answers="SAT's CUDA memory line reads all zeros on a CPU rank; printed only where CUDA is present",
          expect=expect_params("name")),
]
