"""Diagnostics never end a run: the first exception one raises is printed once with its traceback, and that
diagnostic is off for the rest of the process while training goes on."""
from __future__ import annotations

import sys
import threading
import traceback
from typing import Any, Callable


class Diagnostic:
    """One diagnostic that may fail: :meth:`run` calls through it until the first failure."""

    def __init__(self, name: str):
        self.name = name
        self.off = False
        self._lock = threading.Lock()

    def run(self, fn: Callable, *args, default: Any = None, **kwargs):
        """``fn(*args, **kwargs)``, or ``default`` once this diagnostic is off or when ``fn`` raises."""
        if self.off:
            return default
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001  (any failure of a diagnostic)
            self.fail(traceback.format_exc())
            return default

    def fail(self, trace: str) -> None:
        with self._lock:
            if self.off:
                return
            self.off = True
        sys.stderr.write(f"sat_patches: the {self.name} failed and is off for the rest of this run; training goes "
                         f"on. What failed:\n{trace}")
        sys.stderr.flush()


LEDGER = Diagnostic("memory ledger")
LOSS_CURVE = Diagnostic("loss curve (loss_curve.csv/.png)")
PROGRESS = Diagnostic("progress line")
MODEL_PARALLEL_LOSSES = Diagnostic("comparison of the model-parallel ranks' losses")
HEARTBEAT = Diagnostic("rank heartbeat")
