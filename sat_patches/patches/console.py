"""A run's console says what changes; SAT's bulk diagnostics go into files of the run directory (``--save``, or
``SAT_PATCHES_LEDGER_DIR``): the ~120 argument lines to ``arguments.txt``, the per-interval timer line to
``step_times.csv``, and the CUDA memory line only where CUDA is present. Without a run directory SAT prints as
before.
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
