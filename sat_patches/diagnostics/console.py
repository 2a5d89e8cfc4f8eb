"""Console output written to files of the run directory: the arguments (``arguments.txt``) and the per-interval
timers (``step_times.csv``).
"""
from __future__ import annotations

import csv
import os

import torch.distributed as dist

from .ledger import run_directory

ARGUMENTS_TXT, STEP_TIMES_CSV = "arguments.txt", "step_times.csv"


class CurrentRun:
    """The directory and iteration of the run being logged (set where SAT hands us ``args``)."""
    directory = None
    iteration = None


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


def rank0() -> bool:
    """Rank 0 of the process group, or no process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print_args_to_file(original, args) -> None:
    """SAT's ``print_args`` (~120 lines): with a run directory (and no ``--save-args``) into ``arguments.txt``,
    and one line naming it on rank 0."""
    run_dir = run_directory(args)
    CurrentRun.directory, CurrentRun.iteration = run_dir, getattr(args, "iteration", 0)
    if not run_dir or getattr(args, "save_args", False):  # --save-args: SAT's own copy, as asked
        return original(args)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, ARGUMENTS_TXT)
    with open(path, "w") as f:
        for name, value in vars(args).items():
            f.write(f"{name} = {value!r}\n")
    if rank0():
        print(f"arguments: {len(vars(args))} settings in {path}", flush=True)


def log_timers_to_file(original, timers, names, normalizer=1.0, reset=True):
    """SAT's ``Timers.log`` line per interval: with a run directory, rank 0 writes it to ``step_times.csv``."""
    if not CurrentRun.directory:
        return original(timers, names, normalizer, reset)
    assert normalizer > 0.0
    times = {name: timers.timers[name].elapsed(reset=reset) * 1000.0 / normalizer
             for name in names if name in timers.timers}
    if rank0():
        record_times(CurrentRun.directory, CurrentRun.iteration, times)
