"""Console output written to files of the run directory: the arguments (``arguments.txt``) and the per-interval
timers (``step_times.csv``).
"""
from __future__ import annotations

import csv
import os

from .ledger import run_directory

ARGUMENTS_TXT, STEP_TIMES_CSV = "arguments.txt", "step_times.csv"


class CurrentRun:
    """The directory and iteration of the run being logged (set where SAT hands us ``args``)."""
    directory = None
    iteration = None


def write_arguments(args, path: str) -> None:
    with open(path, "w") as f:
        for name, value in vars(args).items():
            f.write(f"{name} = {value!r}\n")


def record_times(run_dir: str, iteration, times: dict) -> None:
    path = os.path.join(run_dir, STEP_TIMES_CSV)
    fresh = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if fresh:
            writer.writerow(["iteration", *[f"{name}_ms" for name in times]])
        writer.writerow([iteration, *[f"{ms:.2f}" for ms in times.values()]])


def note_iteration(args, step) -> None:
    """Called with each progress line: the iteration the next timer row belongs to."""
    CurrentRun.directory, CurrentRun.iteration = run_directory(args), step
