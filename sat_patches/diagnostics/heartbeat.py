"""Dead ranks named: a heartbeat per rank in the process group's store.

A SIGKILLed rank (host OOM: THUDM/CogVLM#283, #320) leaves the others in a collective until its timeout. Each
rank's :class:`Heartbeat` thread bumps its counter every ``timeout / 10`` s and watches its peers'; a peer silent
for ``SAT_PATCHES_HEARTBEAT_TIMEOUT`` s (default 300) ends the run through :func:`watchdog.fire`. A rank that
finishes marks itself done.
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Dict, Optional

import torch.distributed as dist

from ..core import fenced, settings
from ..core.coordination import PEER_LOST, error_kinds, group_store
from ..runtime.checks import BadInputError
from . import watchdog as hangs

HEARTBEAT_ENV = "SAT_PATCHES_HEARTBEAT_TIMEOUT"


PREFIX = "sat_patches/heartbeat/"


def heartbeat_timeout() -> Optional[float]:
    """Seconds of silence after which a peer is declared dead; None (off) when set to 0."""
    try:
        return settings.read(HEARTBEAT_ENV)
    except ValueError as exc:
        raise BadInputError(str(exc)) from None


class Heartbeat:
    """This rank's beat and its view of every peer's."""

    def __init__(self, store, rank: int, world: int, timeout: float):
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.interval = max(0.05, min(5.0, timeout / 10))
        self.seen: Dict[int, tuple] = {}      # peer -> (counter, monotonic time it last changed)
        self.store_ok = time.monotonic()
        self.reason: Optional[str] = None     # the first dead peer found (by either thread), kept
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sat_patches-heartbeat", daemon=True)

    def beat(self) -> None:
        self.store.add(f"{PREFIX}{self.rank}", 1)

    def done(self) -> None:
        self.close()
        try:
            self.store.set(f"{PREFIX}{self.rank}/done", "1")
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Stop and join the thread (also at exit: a daemon thread caught inside a store call by the interpreter's
        teardown aborts the finished rank, 'terminate called without an active exception')."""
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(self.interval + 1)

    def dead(self, silence: Optional[float] = None) -> Optional[str]:
        """Why a peer counts as dead (silent for ``silence`` s, default the timeout), or None; the first answer kept."""
        if self.reason is None:
            self.reason = self._dead(self.timeout if silence is None else silence)
        return self.reason

    def _dead(self, silence: float) -> Optional[str]:
        now = time.monotonic()
        try:
            for peer in range(self.world):
                if peer == self.rank:
                    continue
                if self.store.check([f"{PREFIX}{peer}/done"]):
                    continue
                count = self.store.add(f"{PREFIX}{peer}", 0)
                if count == 0:
                    continue  # not started yet (still preprocessing/loading): hangs.py's timeouts cover it
                last = self.seen.get(peer)
                if last is None or last[0] != count:
                    self.seen[peer] = (count, now)
                elif now - last[1] > silence:
                    return f"rank {peer} stopped (no heartbeat for {now - last[1]:.0f} s; {HEARTBEAT_ENV}={self.timeout:g})"
            self.store_ok = now
        except Exception as exc:  # noqa: BLE001  (the store's host is gone)
            if now - self.store_ok > silence:
                return (f"rank 0 stopped (no heartbeat for {now - self.store_ok:.0f} s: the store it hosts is "
                        f"unreachable, {type(exc).__name__}; {HEARTBEAT_ENV}={self.timeout:g})")
        return None

    def _run(self) -> None:
        while not self.stop.wait(self.interval) and not fenced.HEARTBEAT.off:
            try:
                self.beat()
            except Exception:  # noqa: BLE001
                pass
            reason = fenced.HEARTBEAT.run(self.dead)
            if reason and not self.stop.is_set():
                hangs.fire(reason, threading.main_thread().ident, leader=True)

    def wait_for_dead(self) -> Optional[str]:
        """After a failed collective: wait at most 3 beats (+ one) for a silent peer to name."""
        silence = min(self.timeout, 3 * self.interval)
        deadline = time.monotonic() + silence + 2 * self.interval
        while time.monotonic() < deadline:
            reason = self.dead(silence)
            if reason:
                return reason
            time.sleep(self.interval)
        return None


_heartbeat: Optional[Heartbeat] = None


def start_heartbeat(timeout: Optional[float] = None) -> Optional[Heartbeat]:
    global _heartbeat
    timeout = heartbeat_timeout() if timeout is None else timeout
    if _heartbeat is not None or timeout is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return _heartbeat
    _heartbeat = Heartbeat(group_store(), dist.get_rank(), dist.get_world_size(), timeout)
    _heartbeat.beat()
    _heartbeat.thread.start()
    atexit.register(_heartbeat.close)
    return _heartbeat


def training_main_with_heartbeat(original, args, *a, **kw):
    """SAT's ``training_main`` with this rank's heartbeat running (THUDM/CogVLM#283, #320: a SIGKILLed rank
    leaves the others waiting, unnamed); a collective failing with a lost peer waits a few beats to name it."""
    heartbeat_timeout()  # a bad setting is the user's to fix: refused, not fenced
    hb = fenced.HEARTBEAT.run(start_heartbeat)
    try:
        result = original(args, *a, **kw)
    except Exception as exc:
        if hb is not None and PEER_LOST in error_kinds(exc):  # a dead peer can cause it: wait a few beats to name it
            reason = hb.wait_for_dead()
            if reason:
                hangs.fire(reason, threading.main_thread().ident, leader=True)
        raise
    if hb is not None:
        hb.done()
    return result
