"""What a run's console says: one short progress line per logged step with an ETA
(:mod:`sat_patches.diagnostics.progress`); SAT's bulk diagnostics go into files of the run directory
(:mod:`sat_patches.diagnostics.console`). Without a run directory SAT prints as before.
"""
from __future__ import annotations

import functools

import torch

from ..core import noise
from ..core.module_patches import QuietThirdPartyPatch
from ..core.registry import Patch, delegate, expect_params
from ..diagnostics.console import log_timers_to_file, print_args_to_file
from ..diagnostics.progress import report_evaluate_metrics_float32, report_iteration_progress


def _report_memory(original):
    @functools.wraps(original)
    def report_memory(name):
        if torch.cuda.is_available():
            return original(name)
    return report_memory


PATCHES = [
    QuietThirdPartyPatch(
        noise.PATCH_NAME, "logging:" + ",".join(noise.QUIETED), make=None,
        answers="every process logged bitsandbytes' 'Failed to load CPU gemm_4bit_forward from kernels-community' "
                "and DeepSpeed's 'Setting accelerator to CPU' at import; sat_patches says the device once on rank 0"),
    Patch("progress_line", "sat.training.deepspeed_training:report_iteration_metrics", delegate(report_iteration_progress),
          answers="SAT logs a long line per log interval with no time left; here one short line with an ETA, and "
                  "the run's loss curve (loss_curve.csv/.png beside the memory ledger)",
          expect=expect_params("summary_writer", "optimizer", "lr", "loss", "elapsed_time", "step", "total_step",
                               "args", "avg_metrics")),
    Patch("evaluation_metrics_float", "sat.training.deepspeed_training:report_evaluate_metrics",
          delegate(report_evaluate_metrics_float32),
          answers="with --bf16, SAT's evaluation hands bf16 metric tensors to TensorBoard's add_scalar ('Got "
                  "unsupported ScalarType BFloat16'): a bf16 run that evaluates dies at its first evaluation",
          expect=expect_params("summary_writer", "prefix", "loss", "ppl", "step", "args", "avg_metrics")),
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
