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

import csv
import datetime
import functools
import logging
import os
import warnings

import torch.distributed as dist

from ..core import fenced, noise
from ..core.registry import Patch, SatPatchesWarning, expect_params
from . import console
from .ledger import run_directory

CURVE_CSV, CURVE_PNG = "loss_curve.csv", "loss_curve.png"
SAT_LINE = "elapsed time per iteration (ms)"


class _DropSatIterationLine(logging.Filter):
    def filter(self, record):
        return SAT_LINE not in record.getMessage()


def progress_line(step, total_step, loss, lr, elapsed_ms, avg_metrics=None, loss_scale=None) -> str:
    eta = datetime.timedelta(seconds=round(max(total_step - step, 0) * elapsed_ms / 1000))
    line = f"iteration {step}/{total_step} | loss {loss:.4f} | lr {lr:.2e} | {elapsed_ms / 1000:.2f} s/it | ETA {eta}"
    for key, value in (avg_metrics or {}).items():
        if key != "loss":  # forward steps that return {"loss": loss} would print it twice
            line += f" | {key} {value:.4f}"
    return line + (f" | loss scale {loss_scale:.1f}" if loss_scale is not None else "")


def record_step(run_dir: str, step: int, loss: float, lr: float, elapsed_ms: float) -> None:
    """Append the step to the run's loss curve and redraw its PNG (when matplotlib is there)."""
    path = os.path.join(run_dir, CURVE_CSV)
    os.makedirs(run_dir, exist_ok=True)
    fresh = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if fresh:
            writer.writerow(["iteration", "loss", "lr", "seconds_per_iteration"])
        writer.writerow([step, loss, lr, elapsed_ms / 1000])
    from ..tools.report import draw_loss_curve
    try:
        draw_loss_curve(run_dir)
    except RuntimeError:  # no matplotlib: the CSV is the curve
        pass


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
]
