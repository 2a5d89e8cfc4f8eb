"""One short line per logged step, with an ETA, and the run's loss curve.

SAT's ``report_iteration_metrics`` (``sat/training/deepspeed_training.py``) logs, every
``--log-interval`` steps, one long line (elapsed ms, learning rate, loss in E-notation, samples per
minute) with no estimate of the time left. Here that line becomes ``iteration 4/20 | loss 6.5213 |
lr 1.00e-04 | 1.32 s/it | ETA 0:00:21`` (metrics and the fp16 loss scale follow when present);
SAT's TensorBoard and wandb reporting run as before. Rank 0 also appends the step to
``loss_curve.csv`` in the run directory (the memory ledger's) and redraws ``loss_curve.png`` there
when matplotlib is installed. Both are fenced (:mod:`sat_patches.core.fenced`): one that fails is
reported once and turned off; training goes on.
"""
from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.distributed as dist

from ..core import fenced, noise
from ..core.registry import Patch, SatPatchesWarning, expect_params
from ..diagnostics import console
from ..diagnostics.ledger import run_directory
from ..diagnostics.progress import SAT_LINE, progress_line, record_step


class _DropSatIterationLine(logging.Filter):
    def filter(self, record):
        return SAT_LINE not in record.getMessage()


def _print_progress(optimizer, lr, loss, elapsed_time, step, total_step, args, avg_metrics) -> None:
    scale = (getattr(optimizer, "cur_scale", None) if args.deepspeed else getattr(optimizer, "loss_scale", None)) \
        if args.fp16 else None
    print(progress_line(step, total_step, loss, lr, elapsed_time, avg_metrics, scale), flush=True)


def _record_curve(run_dir: str, step, loss, lr, elapsed_time) -> None:
    try:
        record_step(run_dir, step, loss, lr, elapsed_time)
    except OSError as exc:  # a full or read-only disk: a warning, the next step tries again
        warnings.warn(f"sat_patches: loss curve not written to {run_dir}: {exc}", SatPatchesWarning)


def _report_iteration_metrics(original):
    @functools.wraps(original)
    def report_iteration_metrics(summary_writer, optimizer, lr, loss, elapsed_time, step, total_step, args,
                                 avg_metrics):
        sat_logger = logging.getLogger("sat")
        quiet = _DropSatIterationLine()
        sat_logger.addFilter(quiet)
        try:  # SAT's TensorBoard / wandb reporting, without its line
            original(summary_writer, optimizer, lr, loss, elapsed_time, step, total_step, args, avg_metrics)
        finally:
            sat_logger.removeFilter(quiet)
        console.note_iteration(args, step)
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        fenced.PROGRESS.run(_print_progress, optimizer, lr, loss, elapsed_time, step, total_step, args, avg_metrics)
        run_dir = run_directory(args)
        if run_dir:
            fenced.LOSS_CURVE.run(_record_curve, run_dir, step, loss, lr, elapsed_time)
    return report_iteration_metrics


def _report_evaluate_metrics(original):
    """SAT's evaluation report with its metrics as float32: a bf16 run's metrics (a script that returns its
    loss in the model's dtype, as SAT's ChatGLM2 example does) are bf16 tensors, which TensorBoard's
    ``add_scalar`` refuses ("Got unsupported ScalarType BFloat16") at the run's first evaluation."""

    @functools.wraps(original)
    def report_evaluate_metrics(summary_writer, prefix, loss, ppl, step, args, avg_metrics):
        if avg_metrics:
            avg_metrics = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v
                           for k, v in avg_metrics.items()}
        return original(summary_writer, prefix, loss, ppl, step, args, avg_metrics)
    return report_evaluate_metrics


class QuietThirdPartyPatch(Patch):
    """The log filters of :mod:`sat_patches.core.noise` as a registry entry (they go on at ``import
    sat_patches``, before SAT imports the libraries that log; listed, restorable, disable-able here)."""

    def current(self):
        return noise.is_installed()

    def is_applied(self) -> bool:
        return self.current()

    def apply(self, force: bool = False) -> None:
        noise.install()
        self.status, self.reason = "applied", ""

    def restore(self) -> None:
        if self.status == "applied":
            noise.remove()
            self.status, self.reason = "restored", ""


PATCHES = [
    QuietThirdPartyPatch(
        noise.PATCH_NAME, "logging:" + ",".join(noise.QUIETED), make=None,
        answers="every process logged bitsandbytes' 'Failed to load CPU gemm_4bit_forward from kernels-community' "
                "and DeepSpeed's 'Setting accelerator to CPU' at import; sat_patches says the device once on rank 0"),
    Patch("progress_line", "sat.training.deepspeed_training:report_iteration_metrics", _report_iteration_metrics,
          answers="SAT logs a long line per log interval with no time left; here one short line with an ETA, and "
                  "the run's loss curve (loss_curve.csv/.png beside the memory ledger)",
          expect=expect_params("summary_writer", "optimizer", "lr", "loss", "elapsed_time", "step", "total_step",
                               "args", "avg_metrics")),
    Patch("evaluation_metrics_float", "sat.training.deepspeed_training:report_evaluate_metrics",
          _report_evaluate_metrics,
          answers="with --bf16, SAT's evaluation hands bf16 metric tensors to TensorBoard's add_scalar ('Got "
                  "unsupported ScalarType BFloat16'): a bf16 run that evaluates dies at its first evaluation",
          expect=expect_params("summary_writer", "prefix", "loss", "ppl", "step", "args", "avg_metrics")),
]
