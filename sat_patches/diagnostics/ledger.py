"""The memory ledger: each rank's host RSS and CUDA memory at each phase of a run, the per-rank table rank 0
prints and writes into the run directory (:mod:`sat_patches.diagnostics.ledger_files`).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..core import fenced, settings
from .ledger_files import MiB, Row, flagged, format_table, host_memory, latest_per_rank, write


def cuda_memory() -> Dict[str, float]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    c = torch.cuda
    return {"cuda_alloc_mib": c.memory_allocated() / MiB, "cuda_max_alloc_mib": c.max_memory_allocated() / MiB,
            "cuda_reserved_mib": c.memory_reserved() / MiB, "cuda_max_reserved_mib": c.max_memory_reserved() / MiB}


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def enabled() -> bool:
    return settings.read("SAT_PATCHES_LEDGER")


class Ledger:
    """One per process: rows recorded here, gathered to rank 0 at :meth:`flush`."""

    def __init__(self):
        self.start = time.time()
        self.rows: List[Row] = []          # this rank's rows
        self.pending: List[Row] = []       # not yet gathered
        self.table: List[Row] = []         # rank 0: every rank's gathered rows
        self.steps = 0
        self._depth = threading.local()

    def record(self, phase: str, iteration: int = 0) -> Row:
        now = time.time()
        row = Row(rank=_rank(), phase=phase, iteration=iteration, time=now, elapsed=now - self.start,
                  **host_memory(), **cuda_memory())
        self.rows.append(row)
        self.pending.append(row)
        return row

    @contextlib.contextmanager
    def phase(self, name: str, once: bool = False):
        """Record ``name`` when the outermost such block of this thread ends (nested builds count
        once); with ``once``, only the first time."""
        depth = getattr(self._depth, name, 0)
        setattr(self._depth, name, depth + 1)
        try:
            yield
        finally:
            setattr(self._depth, name, depth)
        if depth == 0 and enabled() and not (once and any(r.phase == name for r in self.rows)):
            fenced.LEDGER.run(self.record, name)  # only when the call returned

    def gather(self) -> List[Row]:
        """Every rank's pending rows, on rank 0 (a collective: all ranks call it at the same step)."""
        mine, self.pending = [asdict(r) for r in self.pending], []
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [Row(**r) for r in mine]
        boxes = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, boxes, dst=0)  # torch picks the group's object device (CUDA for NCCL)
        return [Row(**r) for box in (boxes or []) for r in box]

    def flush(self, run_dir: Optional[str], title: str = "") -> List[Row]:
        """Gather; rank 0 writes the rows, and prints the table the first time and when a rank stands far above."""
        new = self.gather()  # every rank takes part, even with the ledger off here (the others wait for it)
        if _rank() == 0:
            fenced.LEDGER.run(self._show, new, run_dir, title)
        return new

    def _show(self, new: List[Row], run_dir: Optional[str], title: str) -> None:
        first = not self.table
        self.table.extend(new)
        if run_dir:
            write(run_dir, new, self.table, fresh=first)
        flags = flagged(self.table)
        if first or flags["host"] or flags["cuda"]:
            shown = new if first else latest_per_rank(new)
            print(format_table(shown, self.table, title=title, where=run_dir), flush=True)


LEDGER = Ledger()


def run_directory(args=None) -> Optional[str]:
    return getattr(args, "save", None) or None


def train_step_recorded(original, data_iterator, model, optimizer, lr_scheduler, args, timers, *a, **kw):
    """SAT's ``train_step``, with :data:`LEDGER` recording the first step and each log interval's last, then
    gathering the rows to rank 0, which writes and prints them."""
    result = original(data_iterator, model, optimizer, lr_scheduler, args, timers, *a, **kw)
    if not enabled():
        return result
    LEDGER.steps += 1
    iteration = getattr(args, "iteration", 0) + 1       # train() counts the step after train_step returns
    interval = max(1, getattr(args, "log_interval", 1) or 1)
    first = LEDGER.steps == 1
    if first or iteration % interval == 0:
        fenced.LEDGER.run(LEDGER.record, "first_step" if first else "step", iteration)
        LEDGER.flush(run_directory(args), title=f"after the first step (iteration {iteration})" if first
                     else f"iteration {iteration}")
    return result
