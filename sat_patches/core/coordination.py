"""Ranks coordinating through the process group's store: stages, barriers with a timeout naming where late
ranks are, node ranks and ``LOCAL_WORLD_SIZE``, and what a failed collective's error says happened.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import warnings
from typing import Dict, FrozenSet, List, Optional, Tuple

import torch.distributed as dist

from .registry import SatPatchesWarning
from . import settings


class LoadTimeout(RuntimeError):
    """Other ranks did not reach a loading barrier in time; names the stage they are at."""


def load_timeout() -> float:
    return settings.read("SAT_PATCHES_LOAD_TIMEOUT")


_barriers = 0


def group_store(single_rank_too: bool = False):
    """The default process group's store; None without a group or (unless ``single_rank_too``) with one rank."""
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if not single_rank_too and dist.get_world_size() == 1:
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  (the default group went away meanwhile)
        return None


TIMED_OUT, PEER_LOST, NO_BACKEND = "timed out", "peer lost", "no backend"
_ERROR_TEXTS = {  # lower-case pieces of the messages of gloo, NCCL and torch.distributed
    TIMED_OUT: ("timed out", "timeout", "watchdog caught collective"),
    PEER_LOST: ("connection closed", "connection reset", "broken pipe", "by peer", "nccl error", "ncclremoteerror",
                "ncclsystemerror"),
    NO_BACKEND: ("no backend type associated with device type",),
}


def error_kinds(exc: BaseException) -> FrozenSet[str]:
    """What a failed collective or store call says happened: :data:`TIMED_OUT`, :data:`PEER_LOST` (also any
    c10d ``DistError``), :data:`NO_BACKEND`; empty for an error of this rank's own."""
    text = str(exc).lower()
    kinds = {kind for kind, texts in _ERROR_TEXTS.items() if any(t in text for t in texts)}
    if isinstance(exc, dist.DistError):
        kinds.add(PEER_LOST)
    return frozenset(kinds)


@contextlib.contextmanager
def stage(name: str):
    """Announce what this rank is doing, for the messages of a rank waiting at a :func:`barrier`."""
    store = group_store()
    if store is not None:
        store.set(f"sat_patches/stage/{dist.get_rank()}", f"{time.time()}|{name}")
    yield


def barrier(name: str, timeout: Optional[float] = None) -> None:
    """Wait for every rank, at most ``timeout`` s (``SAT_PATCHES_LOAD_TIMEOUT``), else :class:`LoadTimeout`."""
    global _barriers
    store = group_store()
    if store is None:
        return
    timeout = load_timeout() if timeout is None else timeout
    _barriers += 1
    me, world = dist.get_rank(), dist.get_world_size()
    key = f"sat_patches/barrier/{_barriers}/"
    with stage(f"waiting at '{name}'"):
        store.set(key + str(me), "1")
    _wait(store, [key + str(r) for r in range(world)], timeout, name)
    store.set(key + f"left/{me}", "1")
    if me == 0:  # rank 0 usually hosts the store: it leaves last, so no rank loses the store while waiting
        _wait(store, [key + f"left/{r}" for r in range(world)], timeout, name)


def _wait(store, keys: List[str], timeout: float, name: str) -> None:
    me = dist.get_rank()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except dist.DistNetworkError as exc:
        raise RuntimeError(f"rank {me} lost the process group's store at '{name}': the rank that hosts it "
                           f"(usually rank 0) exited or crashed; see that rank's log") from exc
    except (dist.DistError, RuntimeError) as exc:
        late = [r for r, k in enumerate(keys) if not store.check([k])]
        raise LoadTimeout(f"rank {me} waited {timeout:.0f} s at '{name}' for rank(s) {late}: "
                          + "; ".join(_stage_of(store, r) for r in late)
                          + f". Look at those ranks (hung, or slower storage), or raise SAT_PATCHES_LOAD_TIMEOUT "
                            f"(now {timeout:.0f} s).") from exc


def _stage_of(store, rank: int) -> str:
    key = f"sat_patches/stage/{rank}"
    if not store.check([key]):
        return f"rank {rank} has not started loading"
    since, _, what = store.get(key).decode().partition("|")
    return f"rank {rank} is at stage '{what}' for {time.time() - float(since):.0f} s"


def store_gather(name: str, value: str, timeout: Optional[float] = None) -> List[str]:
    """Every rank's ``value`` (rank order), exchanged through the store (no tensors: any backend)."""
    store = group_store()
    if store is None:
        return [value]
    key = f"sat_patches/{name}/"
    store.set(key + str(dist.get_rank()), value)
    keys = [key + str(r) for r in range(dist.get_world_size())]
    store.wait(keys, datetime.timedelta(seconds=load_timeout() if timeout is None else timeout))
    return [store.get(k).decode() for k in keys]


_node_ranks: Dict[Tuple[int, int], List[int]] = {}   # (rank, world size) -> the global ranks on its node


def check_local_world_size() -> Optional[int]:
    """Set ``LOCAL_WORLD_SIZE`` (SAT's node groups) to the ranks really on this node (same host and launcher node
    rank), warning where it differed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    me = (dist.get_rank(), dist.get_world_size())
    if me not in _node_ranks:
        node = "|".join((socket.gethostname(), os.environ.get("GROUP_RANK") or os.environ.get("CROSS_RANK")
                         or os.environ.get("NODE_RANK") or ""))
        _node_ranks[me] = [r for r, n in enumerate(store_gather("node", node)) if n == node]
    ranks = _node_ranks[me]
    real, said = len(ranks), os.environ.get("LOCAL_WORLD_SIZE")
    world = me[1]
    contiguous = ranks == list(range(ranks[0], ranks[0] + real)) and ranks[0] % real == 0 and world % real == 0
    if not contiguous:
        warnings.warn(f"ranks {ranks} share this node: SAT's node groups assume consecutive blocks of "
                      f"LOCAL_WORLD_SIZE ranks per node; leaving LOCAL_WORLD_SIZE={said}", SatPatchesWarning)
        return None
    if said is None:  # SAT would guess min(world size, 8)
        os.environ["LOCAL_WORLD_SIZE"] = str(real)
    elif said != str(real):
        warnings.warn(f"LOCAL_WORLD_SIZE={said} but this node runs {real} rank(s) {ranks} (a launcher "
                      f"environment such as CogVLM's .deepspeed_env sets it): using LOCAL_WORLD_SIZE={real} "
                      f"for SAT's node groups", SatPatchesWarning)
        os.environ["LOCAL_WORLD_SIZE"] = str(real)
    return real

