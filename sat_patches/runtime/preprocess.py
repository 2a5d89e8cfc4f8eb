"""Rank 0 first: :func:`rank0_first` runs a step (data preprocessing) on rank 0 while the other ranks wait
behind a gloo barrier with its own timeout, then on the others; a failure on rank 0 is told to every rank.
"""
from __future__ import annotations

import datetime
from typing import Callable

import torch.distributed as dist

from ..core import settings

ENV = "SAT_PATCHES_PREPROCESS_TIMEOUT"


STAGE = "preparing the data sets (make_loaders)"


KEY_PREFIX = "sat_patches/preprocess/"


READ_WAIT = 60.0   # at most this long, a failed rank 0 waits for the others to read its error


_group = None


_calls = 0


def preprocess_timeout() -> float:
    """``SAT_PATCHES_PREPROCESS_TIMEOUT`` in seconds (default 7200)."""
    return settings.read(ENV)


def _gloo_group(timeout: float):
    """The dedicated gloo group; created once, at the first call, by every rank (make_loaders runs on all)."""
    global _group
    if _group is None:
        _group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    return _group


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _last_line(exc: BaseException) -> str:
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def rank0_first(run: Callable, stage: str = STAGE):
    """Call ``run()`` on global rank 0, then on every other rank once rank 0 succeeded (see module doc)."""
    global _calls
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return run()
    timeout = preprocess_timeout()
    group = _gloo_group(timeout)
    store = dist.distributed_c10d._get_default_store()
    _calls += 1  # every rank calls as often: one key per call
    key = f"{KEY_PREFIX}{_calls}"
    if dist.get_rank() == 0:
        return _lead(run, stage, group, store, key, timeout)
    return _follow(run, stage, group, store, key, timeout)


def _barrier(group, timeout: float) -> None:
    dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)


def _lead(run, stage, group, store, key, timeout):
    try:
        result = run()
    except BaseException as exc:
        store.set(key, f"failed: {_describe(exc)}")
        try:
            _barrier(group, timeout)
            # the others read the store after the barrier; it lives in this process: wait until they have
            readers = [f"{key}/read/{r}" for r in range(1, dist.get_world_size())]
            store.wait(readers, datetime.timedelta(seconds=min(timeout, READ_WAIT)))
        except Exception:  # noqa: BLE001  (the others are gone already; this rank's own error matters)
            pass
        raise
    store.set(key, "done")
    try:
        _barrier(group, timeout)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank 0 finished {stage}, but not every other rank was still waiting for it: they exited, or "
            f"gave up after {ENV}={timeout:g} s (raise it if preprocessing needs longer). See their logs. "
            f"[{_last_line(exc)}]") from exc
    return result


def _follow(run, stage, group, store, key, timeout):
    rank = dist.get_rank()
    try:
        _barrier(group, timeout)
        outcome = store.get(key).decode(errors="replace")
    except RuntimeError as exc:  # gloo's timeout, or the connection to a dead rank 0 closed
        text = str(exc).lower()
        why = (f"it did not finish within {timeout:g} s" if "timed out" in text or "timeout" in text
               else "it exited or was killed (its connection closed)")
        raise RuntimeError(
            f"rank {rank}: gave up waiting for rank 0 while it was {stage}: {why}. Check rank 0's log; if "
            f"preprocessing just needs longer, raise {ENV} (now {timeout:g} s). [{_last_line(exc)}]") from exc
    if outcome != "done":
        try:
            store.set(f"{key}/read/{rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        error = outcome[len("failed: "):] if outcome.startswith("failed: ") else outcome
        raise RuntimeError(f"rank {rank}: rank 0 failed while {stage}: {error} "
                           f"(rank 0's log has its traceback); this rank stops too")
    return run()
