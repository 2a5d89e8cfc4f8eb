"""The progress line (``iteration 4/20 | loss 6.52 | ... | ETA 0:00:21``), the run's loss curve
(``loss_curve.csv``, drawn as ``loss_curve.png``), and the model-parallel ranks' losses compared.
"""
from __future__ import annotations

import csv
import datetime
import logging
import os
import time
import warnings
from typing import Dict

import torch
import torch.distributed as dist

from ..core import fenced
from ..core.registry import SatPatchesWarning
from ..runtime import collectives
from . import console
from .charts import CURVE_CSV, draw_loss_curve
from .ledger import run_directory


SAT_LINE = "elapsed time per iteration (ms)"


def progress_line(step, total_step, loss, lr, elapsed_ms, avg_metrics=None, loss_scale=None) -> str:
    eta = datetime.timedelta(seconds=round(max(total_step - step, 0) * elapsed_ms / 1000))
    line = f"iteration {step}/{total_step} | loss {loss:.4f} | lr {lr:.2e} | {elapsed_ms / 1000:.2f} s/it | ETA {eta}"
    for key, value in (avg_metrics or {}).items():
        if key != "loss":  # forward steps that return {"loss": loss} would print it twice
            line += f" | {key} {value:.4f}"
    return line + (f" | loss scale {loss_scale:.1f}" if loss_scale is not None else "")


CURVE_COLUMNS = ("iteration", "loss", "lr", "seconds_per_iteration", "model_parallel_loss_spread")
# the model-parallel ranks of a group compute one loss from the same batch and gathered logits: equal to the bit
SPREAD_TOLERANCE = 1e-6


REDRAW_SECONDS = 60.0  # the PNG is redrawn at most this often (and at the last step); the CSV gets every step
_last_drawn: Dict[str, float] = {}  # run directory -> time.monotonic() of its last drawing, or of its first record


def record_step(run_dir: str, step: int, loss: float, lr: float, elapsed_ms: float, spread: float = 0.0,
                last: bool = False) -> None:
    """Append the step to the run's loss curve; redraw its PNG (with matplotlib) at the ``last`` step and every
    :data:`REDRAW_SECONDS`. ``spread``: :func:`model_parallel_spread`. A full or read-only disk is only warned
    about (the next step tries again)."""
    path = os.path.join(run_dir, CURVE_CSV)
    try:
        os.makedirs(run_dir, exist_ok=True)
        fresh = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.writer(f)
            if fresh:
                writer.writerow(CURVE_COLUMNS)
            writer.writerow([step, loss, lr, elapsed_ms / 1000, spread])
        now = time.monotonic()
        if not last and now - _last_drawn.setdefault(run_dir, now) < REDRAW_SECONDS:
            return
        _last_drawn[run_dir] = now
        try:
            draw_loss_curve(run_dir)
        except RuntimeError:  # no matplotlib: the CSV is the curve
            pass
    except OSError as exc:
        warnings.warn(f"sat_patches: loss curve not written to {run_dir}: {exc}", SatPatchesWarning)


def not_sat_iteration_line(record: logging.LogRecord) -> bool:
    """A filter of the ``sat`` logger dropping SAT's own per-interval iteration line (:data:`SAT_LINE`)."""
    return SAT_LINE not in record.getMessage()


def print_progress(optimizer, lr, loss, elapsed_time, step, total_step, args, avg_metrics) -> None:
    """Print :func:`progress_line` for this step (with the fp16 loss scale when there is one)."""
    scale = (getattr(optimizer, "cur_scale", None) if args.deepspeed else getattr(optimizer, "loss_scale", None)) \
        if args.fp16 else None
    print(progress_line(step, total_step, loss, lr, elapsed_time, avg_metrics, scale), flush=True)


def model_parallel_spread(loss: float, step: int) -> float:
    """The largest difference between the losses of this rank's model-parallel group, which must be equal (the
    same batch, the same gathered logits); the group's first rank warns, with every loss, where they differ."""
    losses = collectives.model_parallel_values(loss)
    spread = max(losses) - min(losses)
    if spread > SPREAD_TOLERANCE * max(1.0, abs(loss)) and collectives.get_model_parallel_rank() == 0:
        each = ", ".join(f"{v:.6g}" for v in losses)
        warnings.warn(f"sat_patches: at iteration {step} the model-parallel ranks of one group report different "
                      f"losses ({each}, in model-parallel rank order): they must see the same batch and hold the "
                      f"parts of one model. Check that the batch is broadcast within the group (SAT's "
                      f"broadcast_data in the forward step) and that each rank loaded its own shard.",
                      SatPatchesWarning)
    return spread


def report_iteration_progress(original, summary_writer, optimizer, lr, loss, elapsed_time, step, total_step, args,
                              avg_metrics) -> None:
    """SAT's ``report_iteration_metrics`` without its long line (TensorBoard / wandb as before); rank 0 prints
    :func:`progress_line` and appends the step to the loss curve, both fenced."""
    sat_logger = logging.getLogger("sat")
    sat_logger.addFilter(not_sat_iteration_line)
    try:  # SAT's TensorBoard / wandb reporting, without its line
        original(summary_writer, optimizer, lr, loss, elapsed_time, step, total_step, args, avg_metrics)
    finally:
        sat_logger.removeFilter(not_sat_iteration_line)
    console.note_iteration(args, step)
    # every rank reaches this call at the same iteration: the gather within each model-parallel group is safe here
    spread = fenced.MODEL_PARALLEL_LOSSES.run(model_parallel_spread, loss, step, default=0.0)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    fenced.PROGRESS.run(print_progress, optimizer, lr, loss, elapsed_time, step, total_step, args, avg_metrics)
    run_dir = run_directory(args)
    if run_dir:
        fenced.LOSS_CURVE.run(record_step, run_dir, step, loss, lr, elapsed_time, spread, step >= total_step)


def report_evaluate_metrics_float32(original, summary_writer, prefix, loss, ppl, step, args, avg_metrics):
    """SAT's ``report_evaluate_metrics`` with bf16 metrics as float32 (TensorBoard refuses "unsupported
    ScalarType BFloat16")."""
    if avg_metrics:
        avg_metrics = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v
                       for k, v in avg_metrics.items()}
    return original(summary_writer, prefix, loss, ppl, step, args, avg_metrics)
