"""Data preprocessing on rank 0 first, the other ranks waiting behind a barrier with a timeout.

SAT's ``training_main`` calls ``make_loaders(args, create_dataset_function, collate_fn)`` on every rank
at the same time, before the model is built. ``make_loaders`` calls the user's
``create_dataset_function(path, args)`` (CogVLM: an ``ItemDataset`` over a folder of images, where
users preprocess and cache) and contains no collective. So:

* the ranks that finish early wait in the next NCCL collective while a slow rank preprocesses, and
  NCCL's watchdog aborts them (30 min by default);
* a rank that raises while preprocessing leaves the others waiting in that collective, told nothing.

The patch ``preprocess_rank0_first`` runs ``make_loaders`` on global rank 0 first. The other ranks
wait in ``dist.monitored_barrier`` on a dedicated gloo group whose timeout is
``SAT_PATCHES_PREPROCESS_TIMEOUT`` seconds (default 7200), so no NCCL collective is open meanwhile.
Rank 0 then posts "done" or "failed: <ExcType: message>" in the default process group's store and
joins the barrier. On "done" the others run ``make_loaders`` themselves (reading what rank 0 cached);
on "failed" they raise at once, naming rank 0 and its error, and rank 0 re-raises its own exception.
A rank 0 that is killed or exceeds the timeout makes the others raise an error naming rank 0, the
stage and ``SAT_PATCHES_PREPROCESS_TIMEOUT``. One process, or no process group: SAT's code unchanged.

Interplay with the other patches:

* ``hangs`` times ``torch.distributed`` collectives with ``SAT_PATCHES_COLLECTIVE_TIMEOUT``, which
  would cut a long preprocessing wait. ``monitored_barrier`` is not in ``hangs.COLLECTIVES`` and calls
  the group's C++ ``monitored_barrier`` directly (no wrapped ``barrier`` inside), so this wait is bounded
  only by ``SAT_PATCHES_PREPROCESS_TIMEOUT`` (tests/test_preprocess.py checks that it stays so).
  ``hangs.start_watchdog`` shortens the timeout of the groups that exist when it runs (in SAT's
  ``initialize_distributed``); the group here is created later, at the first ``make_loaders``.
* ``faults``' heartbeat thread keeps beating on every rank meanwhile: rank 0's thread runs beside its
  preprocessing, and the waiting ranks' threads run because ``monitored_barrier`` releases the GIL.
"""
from __future__ import annotations

import datetime
import functools
from typing import Callable, TypeVar

import torch.distributed as dist

from ..core.registry import Patch, expect_names
from ..core import settings

ENV = "SAT_PATCHES_PREPROCESS_TIMEOUT"
STAGE = "preparing the data sets (make_loaders)"
KEY_PREFIX = "sat_patches/preprocess/"
READ_WAIT = 60.0   # at most this long, a failed rank 0 waits for the others to read its error

T = TypeVar("T")
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


def rank0_first(run: Callable[[], T], stage: str = STAGE) -> T:
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


def _make_loaders(original):
    """SAT's make_loaders (every rank at once in stock SAT), run on rank 0 first."""
    @functools.wraps(original)
    def make_loaders(*args, **kwargs):
        return rank0_first(functools.partial(original, *args, **kwargs))
    return make_loaders


PATCHES = [
    Patch("preprocess_rank0_first", "sat.data_utils.configure_data:make_loaders", _make_loaders,
          answers="stock SAT: make_loaders ran on every rank at once, so ranks done early hit the NCCL watchdog "
                  "while one preprocessed and a rank crashing in preprocessing left the others hanging; rank 0 now "
                  "goes first behind a gloo barrier (SAT_PATCHES_PREPROCESS_TIMEOUT) and its failure is reported",
          expect=expect_names("make_dataset_full", "make_data_loader")),
]
