"""The progress line (``iteration 4/20 | loss 6.52 | ... | ETA 0:00:21``) and the run's loss curve
(``loss_curve.csv``, drawn as ``loss_curve.png``).
"""
from __future__ import annotations

import csv
import datetime
import os

from .charts import draw_loss_curve

CURVE_CSV, CURVE_PNG = "loss_curve.csv", "loss_curve.png"


SAT_LINE = "elapsed time per iteration (ms)"


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
    try:
        draw_loss_curve(run_dir)
    except RuntimeError:  # no matplotlib: the CSV is the curve
        pass
