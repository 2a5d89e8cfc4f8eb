"""The hang watchdog: a collective that does not complete within the collective timeout ends the run on every
rank with each rank's Python stacks and exit status :data:`EXIT_CODE` (124, as coreutils' ``timeout``).
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import threading
import time
from typing import Dict, Optional

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout, _world

from ..core import settings
from ..core.coordination import TIMED_OUT, error_kinds, group_store

ENV = "SAT_PATCHES_COLLECTIVE_TIMEOUT"


EXIT_CODE = 124                 # as coreutils' timeout


STORE_KEY = "sat_patches/collective_timeout"


GRACE = 30.0                    # the faulthandler backstop fires this long after the Python watchdog should have


MAX_BACKSTOP = 7 * 24 * 3600.0


COLLECTIVES = ("barrier", "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast_object_list", "gather", "send", "recv")


def collective_timeout() -> Optional[float]:
    """``SAT_PATCHES_COLLECTIVE_TIMEOUT`` in seconds, or None when unset."""
    return settings.read(ENV)


class Watchdog:
    """This rank's running collectives (per thread) and the other ranks' reported timeouts."""

    def __init__(self, timeout: float, poll: float):
        self.timeout, self.poll = timeout, poll
        self.inflight: Dict[int, tuple] = {}         # thread id -> (collective name, start time)
        self.local = threading.local()
        self.fired = threading.Lock()
        self.stop = threading.Event()
        self.store_failures = 0
        self.backstop_lock = threading.Lock()
        self.backstop_at: Optional[float] = None     # when faulthandler's backstop exits the process
        self.thread = threading.Thread(target=self._run, name="sat_patches-hang-watchdog", daemon=True)

    # -- the timed region around one collective --------------------------------------
    def enter(self, name: str) -> bool:
        """Start timing ``name`` unless this thread is already inside a timed collective."""
        if getattr(self.local, "depth", 0):
            self.local.depth += 1
            return False
        self.local.depth = 1
        started = time.monotonic()
        self.inflight[threading.get_ident()] = (name, started)
        at = started + self.timeout + GRACE
        # re-armed at most once per poll interval however many collectives run
        if threading.current_thread() is threading.main_thread() and (
                self.backstop_at is None or self.backstop_at < at - self.poll):
            with self.backstop_lock:
                self._arm_backstop(at)
        return True

    def leave(self, outermost: bool) -> None:
        self.local.depth -= 1
        if outermost:
            self.inflight.pop(threading.get_ident(), None)  # the backstop moves on at the watchdog's next look

    # -- faulthandler's backstop ---------------------------------------------------------
    def _arm_backstop(self, at: Optional[float]) -> None:
        """(holding ``backstop_lock``) Exit with stacks at monotonic time ``at``; None: never."""
        if at is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            delay = min(max(at - time.monotonic(), 1.0), MAX_BACKSTOP)
            faulthandler.dump_traceback_later(delay, exit=True, file=sys.stderr)
        self.backstop_at = at

    def _move_backstop(self) -> None:
        """Timeout + grace after the main thread's running collective; cancelled when there is none."""
        main = self.inflight.get(threading.main_thread().ident)
        with self.backstop_lock:
            wanted = None if main is None else main[1] + self.timeout + GRACE
            if wanted != self.backstop_at and (wanted is None or self.backstop_at is None
                                               or abs(wanted - self.backstop_at) > self.poll):
                self._arm_backstop(wanted)

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stop.wait(self.poll):
            for thread_id, (name, started) in list(self.inflight.items()):
                if time.monotonic() - started > self.timeout:
                    fire(f"collective '{name}' did not complete within {self.timeout:g} s", thread_id, leader=True)
            self._move_backstop()
            posted = self._posted()
            if posted is not None:
                thread_id = next(iter(self.inflight), threading.main_thread().ident)
                fire(f"another rank reported a collective timeout ({posted})", thread_id, leader=False,
                     in_collective=bool(self.inflight))

    def _posted(self) -> Optional[str]:
        """What another rank posted in the store; after repeated store failures (the rank hosting
        the store is gone), a message saying so."""
        store = group_store(single_rank_too=True)
        if store is None:
            return None
        try:
            found = store.check([STORE_KEY])
            self.store_failures = 0
            return store.get(STORE_KEY).decode(errors="replace") if found else None
        except Exception as exc:  # noqa: BLE001
            self.store_failures += 1
            if self.store_failures >= 3 and self.inflight:
                return f"the process group's store is unreachable ({type(exc).__name__}): its host rank has exited"
            return None


_watchdog: Optional[Watchdog] = None


def start_watchdog(timeout: Optional[float] = None) -> Watchdog:
    """Start (once) this rank's watchdog; set the timeout of every existing process group when
    ``SAT_PATCHES_COLLECTIVE_TIMEOUT`` (or ``timeout``) is given."""
    global _watchdog
    chosen = timeout if timeout is not None else collective_timeout()
    if chosen is not None and dist.is_initialized():
        for group in list(_world.pg_map):
            try:
                _set_pg_timeout(datetime.timedelta(seconds=chosen), group)
            except (RuntimeError, ValueError, AssertionError):
                pass  # a group this rank is not part of, or a backend without a settable timeout
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    seconds = chosen if chosen is not None else dist.distributed_c10d.default_pg_timeout.total_seconds()
    if _watchdog is None:
        _watchdog = Watchdog(seconds, poll=min(1.0, max(0.1, seconds / 10)))
        _watchdog.thread.start()
    else:
        _watchdog.timeout = seconds
    return _watchdog


def current_watchdog() -> Optional[Watchdog]:
    """This rank's watchdog, None before :func:`start_watchdog`."""
    return _watchdog


def in_collective() -> bool:
    """True while a thread of this rank is inside a timed collective."""
    return bool(_watchdog is not None and _watchdog.inflight)


def blocked_call(thread_id: Optional[int], in_collective: bool = True) -> str:
    """Where a thread is: in a collective, its innermost SAT frame (else its innermost frame outside
    torch); otherwise its innermost SAT frame, else its innermost frame."""
    frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    stack = []
    while frame is not None:
        if frame.f_code.co_filename != __file__:
            stack.append(frame)
        frame = frame.f_back
    in_sat, in_torch = _in_package("sat"), _in_package("torch")
    sat_frame = next((f for f in stack if in_sat(f)), None)
    if in_collective:
        if sat_frame is not None:
            return f"Blocked SAT call: {_where(sat_frame)}"
        caller = next((f for f in stack if not in_torch(f)), None)
        return f"Blocked in: {_where(caller)}" if caller else "Blocked in torch"
    if sat_frame is not None:
        return f"This rank is in no collective; innermost SAT call: {_where(sat_frame)}"
    return f"This rank is in no collective; it is at {_where(stack[0])}" if stack else "No Python frame"


def _where(f) -> str:
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}()"


def _in_package(name: str):
    marker = os.sep + name + os.sep
    return lambda f: marker in f.f_code.co_filename


def fire(reason: str, thread_id: Optional[int], leader: bool, in_collective: bool = True) -> None:
    """Print the header and every thread's stack, tell the other ranks (leader), exit non-zero."""
    if _watchdog is not None and not _watchdog.fired.acquire(blocking=False):
        _watchdog.fired.acquire()  # another thread of this rank is dumping and will exit the process
    try:
        rank = dist.get_rank()
    except Exception:  # noqa: BLE001  (no process group)
        rank = int(os.environ.get("RANK", "0"))
    header = (f"\nsat_patches: rank {rank} (pid {os.getpid()}) at {time.time():.3f}: {reason}. "
              f"{blocked_call(thread_id, in_collective)}. Python stacks of every thread follow; exiting with status "
              f"{EXIT_CODE} ({ENV} sets the timeout).\n")
    sys.stderr.write(header)
    sys.stderr.flush()
    posted = leader and _post(f"rank {rank}: {reason}")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    sys.stdout.flush()
    if posted and _watchdog is not None:
        time.sleep(2 * _watchdog.poll + 1)  # this rank may host the store: let the others read the news
    os._exit(EXIT_CODE)


def _post(message: str) -> bool:
    store = group_store(single_rank_too=True)
    try:
        if store is not None and not store.check([STORE_KEY]):
            store.set(STORE_KEY, message)
            return True
    except Exception:  # noqa: BLE001  (store gone)
        pass
    return False


def timed_collective(original, *args, **kwargs):
    """A blocking ``torch.distributed`` collective (``original``), timed by this rank's watchdog once it runs:
    stock SAT waits silently in a blocked collective (30 min with gloo). A collective that fails with the
    process group's own timeout (same length, it can beat the watchdog) makes the same report (:func:`fire`)."""
    name = original.__name__
    watchdog = current_watchdog()
    if watchdog is None or kwargs.get("async_op"):
        return original(*args, **kwargs)
    outermost = watchdog.enter(name)
    try:
        return original(*args, **kwargs)
    except Exception as exc:
        if watchdog.fired.locked():
            # the watchdog is reporting a hang of this rank and exits the process with EXIT_CODE; a peer that
            # already exited can fail this collective first ("Connection closed by peer"): wait for that exit
            with watchdog.fired:
                raise
        if outermost and TIMED_OUT in error_kinds(exc):
            # the process group's own timeout (same length) can beat the watchdog: same report
            fire(f"collective '{name}' did not complete within {watchdog.timeout:g} s "
                 f"({str(exc).strip().splitlines()[0][:300]})", threading.get_ident(), leader=True)
        raise
    finally:
        watchdog.leave(outermost)
