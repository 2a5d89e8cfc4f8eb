"""The hang watchdog: a collective that does not complete within the collective timeout ends the run on every
rank with each rank's Python stacks, the SAT call it waited in, and exit status :data:`EXIT_CODE` (124, as
coreutils' ``timeout``). Torch's functions are left as they are: the watchdog reads where each thread is
(:func:`sys._current_frames`), SAT's calls are wrapped by :mod:`sat_patches.patches.hangs` (:func:`in_sat_call`),
and the timeouts are the process groups' own.
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout, _world

from ..core import settings
from ..core.coordination import TIMED_OUT, error_kinds, group_store

ENV = "SAT_PATCHES_COLLECTIVE_TIMEOUT"


EXIT_CODE = 124                 # as coreutils' timeout


TERMINATED_EXIT_CODE = 128 + signal.SIGTERM   # as a shell reports a process ended by SIGTERM


STORE_KEY = "sat_patches/collective_timeout"


GRACE = 30.0                    # the faulthandler backstop fires this long after the Python watchdog should have


MAX_BACKSTOP = 7 * 24 * 3600.0


# the blocking torch.distributed functions the watchdog times (not monitored_barrier: it has its own timeout)
COLLECTIVES = ("barrier", "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast_object_list", "gather", "send", "recv")


# torch's NCCL flight recorder: on an NCCL timeout each rank writes its last collectives to a file
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def collective_timeout() -> Optional[float]:
    """``SAT_PATCHES_COLLECTIVE_TIMEOUT`` in seconds, or None when unset."""
    return settings.read(ENV)


def enable_nccl_flight_recorder(environ=os.environ, nccl: Optional[bool] = None) -> List[str]:
    """Where NCCL can run, turn on torch's NCCL flight recorder (read when an NCCL group is created), keeping
    any value the user set. Returns the variables set."""
    if nccl is None:
        nccl = dist.is_nccl_available() and torch.cuda.is_available()
    chosen = [k for k in NCCL_FLIGHT_RECORDER if nccl and k not in environ]
    for key in chosen:
        environ[key] = NCCL_FLIGHT_RECORDER[key]
    return chosen


# -- the SAT calls each thread is in ---------------------------------------------------------
_sat_calls: Dict[int, List[str]] = {}     # thread id -> names of the SAT calls it is in, innermost last


def sat_call_of(thread_id: Optional[int]) -> Optional[str]:
    """The innermost SAT call (wrapped by :mod:`sat_patches.patches.hangs`) the thread is in, or None."""
    calls = _sat_calls.get(thread_id or threading.main_thread().ident)
    return calls[-1] if calls else None


def in_sat_call(name: str, original, *args, **kwargs):
    """Run SAT's ``original``, recorded as "SAT's ``name``" for this rank's reports; a collective in it failing
    with its group's timeout makes the watchdog's report (:func:`fire`)."""
    calls = _sat_calls.setdefault(threading.get_ident(), [])
    calls.append(name)
    try:
        return original(*args, **kwargs)
    except Exception as exc:
        if _watchdog is not None and _watchdog.fired.locked():
            # the watchdog is reporting a hang of this rank and exits the process; a peer that already exited
            # can fail this rank's collective first ("Connection closed by peer"): wait for that exit
            with _watchdog.fired:
                raise
        frames = _traceback_frames(exc)
        # raised by torch.distributed itself (a collective, the store), not an error of SAT's or of ours that
        # mentions a timeout (the preprocessing wait's, say)
        if TIMED_OUT in error_kinds(exc) and frames and _TORCH_DISTRIBUTED in frames[0][0].f_code.co_filename:
            seconds = _watchdog.timeout if _watchdog is not None else _default_timeout()
            collective = _collective_frame(frames)
            waited = collective.f_code.co_name if collective is not None else "?"
            fire(f"collective '{waited}' did not complete within {seconds:g} s "
                 f"({str(exc).strip().splitlines()[0][:300]})", threading.get_ident(), leader=True,
                 where=_describe(frames, True, name))
        raise
    finally:
        calls.pop()


def _traceback_frames(exc: BaseException) -> list:
    """(frame, line) of ``exc``'s traceback, innermost first."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames[::-1]


def _stack_frames(thread_id: Optional[int], frame=None) -> list:
    """(frame, line) of a thread's stack now (from its innermost ``frame`` when given), innermost first,
    without this module's frames."""
    if frame is None:
        frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    frames = []
    while frame is not None:
        if frame.f_code.co_filename != __file__:
            frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    return frames


def _collective_frame(frames: list):
    """The outermost collective (of :data:`COLLECTIVES`) of the innermost run of torch.distributed frames."""
    found = None
    for frame, _ in frames:
        if _TORCH_DISTRIBUTED not in frame.f_code.co_filename:
            break
        if frame.f_code.co_name in COLLECTIVES:
            found = frame
    return found


def _describe(frames: list, in_collective: bool, sat_call: Optional[str]) -> str:
    """Where a thread is: in a collective, its innermost SAT frame (else its innermost frame outside torch);
    otherwise its innermost SAT frame, else its innermost frame. Then the SAT call recorded for it."""
    in_sat, in_torch = _in_package("sat"), _in_package("torch")
    sat_frame = next((f for f in frames if in_sat(f[0])), None)
    recorded = f" (in SAT's {sat_call})" if sat_call else ""
    if in_collective:
        if sat_frame is not None:
            return f"Blocked SAT call: {_where(sat_frame)}{recorded}"
        caller = next((f for f in frames if not in_torch(f[0])), None)
        return (f"Blocked in: {_where(caller)}" if caller else "Blocked in torch") + recorded
    if sat_frame is not None:
        return f"This rank is in no collective; innermost SAT call: {_where(sat_frame)}{recorded}"
    return (f"This rank is in no collective; it is at {_where(frames[0])}" if frames else "No Python frame") + recorded


def blocked_call(thread_id: Optional[int]) -> str:
    """Where a thread of this rank is now (see :func:`_describe`)."""
    frames = _stack_frames(thread_id)
    return _describe(frames, _collective_frame(frames) is not None, sat_call_of(thread_id))


def _where(f) -> str:
    frame, line = f
    return f"{frame.f_code.co_filename}:{line} in {frame.f_code.co_name}()"


def _in_package(name: str):
    marker = os.sep + name + os.sep
    return lambda frame: marker in frame.f_code.co_filename


def _default_timeout() -> float:
    return dist.distributed_c10d.default_pg_timeout.total_seconds()


class Watchdog:
    """A thread ending the run (:func:`fire`) when a thread of this rank stays in one collective call longer than
    ``timeout``, another rank reports in the store, or SIGTERM arrives."""

    def __init__(self, timeout: float, poll: float):
        self.timeout, self.poll = timeout, poll
        self.blocked: Dict[int, tuple] = {}          # thread id -> (collective frame, first seen), kept per poll
        self.fired = threading.Lock()
        self.stop = threading.Event()
        self.store_failures = 0
        self.backstop_at: Optional[float] = None     # when faulthandler's backstop exits the process
        self.wakeup: Optional[socket.socket] = None  # signal.set_wakeup_fd's other end (SIGTERM)
        self.thread = threading.Thread(target=self._run, name="sat_patches-hang-watchdog", daemon=True)

    # -- what the threads are doing ------------------------------------------------------
    def look(self) -> None:
        """Note each thread's collective (the same frame object as at the last look: the same call); report
        one that has lasted longer than the timeout."""
        now, me, seen = time.monotonic(), threading.get_ident(), {}
        for thread_id, innermost in sys._current_frames().items():
            if thread_id == me:
                continue
            frame = _collective_frame(_stack_frames(thread_id, innermost))
            if frame is None:
                continue
            before = self.blocked.get(thread_id)
            seen[thread_id] = before if before is not None and before[0] is frame else (frame, now)
        self.blocked = seen   # (holding the frames keeps a finished call's frame from being reused by the next)
        for thread_id, (frame, since) in seen.items():
            if now - since > self.timeout:
                fire(f"collective '{frame.f_code.co_name}' did not complete within {self.timeout:g} s",
                     thread_id, leader=True)

    # -- faulthandler's backstop -----------------------------------------------------------
    def move_backstop(self) -> None:
        """Exit with stacks (no Python needed) timeout + grace after the main thread's collective began;
        cancelled when it is in none. Re-armed only when the deadline moved by more than a poll."""
        main = self.blocked.get(threading.main_thread().ident)
        wanted = None if main is None else main[1] + self.timeout + GRACE
        if wanted == self.backstop_at or (wanted is not None and self.backstop_at is not None
                                          and abs(wanted - self.backstop_at) <= self.poll):
            return
        if wanted is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            delay = min(max(wanted - time.monotonic(), 1.0), MAX_BACKSTOP)
            faulthandler.dump_traceback_later(delay, exit=True, file=sys.stderr)
        self.backstop_at = wanted

    # -- SIGTERM (torchrun ends the other ranks with it when one fails) -----------------------
    def catch_sigterm(self) -> None:
        """(main thread) On SIGTERM: faulthandler dumps every thread's stack at once (from C, whatever the
        main thread is blocked in), then this thread reports where the rank waited and exits
        :data:`TERMINATED_EXIT_CODE`. Left alone when SIGTERM already has a handler other than the default."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _terminated)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        if signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False) != -1:
            signal.set_wakeup_fd(-1)  # (someone else's) put back: the handler alone reports, once Python runs
            reader.close(), writer.close()
        else:
            self.wakeup, self._writer = reader, writer
        faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
        os.register_at_fork(after_in_child=_forget_sigterm)

    def _wait(self) -> bool:
        """Sleep a poll; True when a SIGTERM arrived meanwhile."""
        if self.wakeup is None:
            self.stop.wait(self.poll)
            return False
        ready, _, _ = select.select([self.wakeup], [], [], self.poll)
        return bool(ready) and signal.SIGTERM in self.wakeup.recv(64)

    # -- the thread ----------------------------------------------------------------------------
    def close(self) -> None:
        """(at exit) Stop and join the thread before the interpreter's teardown: a daemon thread caught there inside
        a store call aborts the finished rank ('terminate called without an active exception')."""
        self.stop.set()
        if self.wakeup is not None:
            try:
                self._writer.send(b"\0")  # out of its select at once (not a SIGTERM: ignored)
            except OSError:
                pass
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(2 * self.poll + 1)

    def _run(self) -> None:
        while not self.stop.is_set():
            if self._wait():
                _terminated()
            self.look()
            self.move_backstop()
            posted = self._posted()
            if posted is not None:
                thread_id = next(iter(self.blocked), threading.main_thread().ident)
                fire(f"another rank ended the run ({posted})", thread_id, leader=False)

    def _posted(self) -> Optional[str]:
        """What another rank posted in the store, or that the store's host is gone while this rank waits."""
        store = group_store(single_rank_too=True)
        if store is None:
            return None
        try:
            found = store.check([STORE_KEY])
            self.store_failures = 0
            return store.get(STORE_KEY).decode(errors="replace") if found else None
        except Exception as exc:  # noqa: BLE001
            self.store_failures += 1
            if self.store_failures >= 3 and self.blocked:
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
        faulthandler.enable(file=sys.stderr, all_threads=True)   # SIGABRT (NCCL's abort), SIGSEGV: stacks
    seconds = chosen if chosen is not None else _default_timeout()
    if _watchdog is None:
        _watchdog = Watchdog(seconds, poll=min(1.0, max(0.1, seconds / 10)))
        _watchdog.catch_sigterm()
        _watchdog.thread.start()
        atexit.register(_watchdog.close)  # runs before the process group's destruction (registered earlier)
    else:
        _watchdog.timeout = seconds
    return _watchdog


def _terminated(*_signal_args) -> None:
    """On SIGTERM: Python's handler (on the main thread, once it runs Python again), or the watchdog thread."""
    fire("received SIGTERM (a launcher such as torchrun ends every rank with it when one rank fails)",
         threading.main_thread().ident, leader=True, status=TERMINATED_EXIT_CODE, stacks_dumped=True)


def _forget_sigterm() -> None:
    """A forked child (a DataLoader worker) is no rank: SIGTERM ends it as before, and its signals stay its own."""
    try:
        faulthandler.unregister(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass


def fire(reason: str, thread_id: Optional[int], leader: bool, where: Optional[str] = None,
         status: int = EXIT_CODE, stacks_dumped: bool = False) -> None:
    """Print the header (``where`` the thread waited, else read from its stack) and every thread's stack (unless
    faulthandler just dumped them), tell the other ranks (leader), exit with ``status``."""
    if _watchdog is not None and not _watchdog.fired.acquire(blocking=False):
        _watchdog.fired.acquire()  # another thread of this rank is dumping and will exit the process
    faulthandler.dump_traceback_later(GRACE, exit=True, file=sys.stderr)   # the report itself cannot hang
    try:
        rank = dist.get_rank()
    except Exception:  # noqa: BLE001  (no process group)
        rank = int(os.environ.get("RANK", "0"))
    stacks = "were dumped above by faulthandler" if stacks_dumped else "follow"
    setting = f" ({ENV} sets the timeout)" if status == EXIT_CODE else ""
    header = (f"\nsat_patches: rank {rank} (pid {os.getpid()}) at {time.time():.3f}: {reason}. "
              f"{where or blocked_call(thread_id)}. Python stacks of every thread {stacks}; exiting with status "
              f"{status}{setting}.\n")
    sys.stderr.write(header)
    sys.stderr.flush()
    posted = leader and _post(f"rank {rank}: {reason}")
    if not stacks_dumped:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    sys.stdout.flush()
    if _watchdog is not None:
        if posted:
            time.sleep(2 * _watchdog.poll + 1)  # this rank may host the store: let the others read the news
        elif not leader:
            _linger(_watchdog.poll)
    os._exit(status)


def _linger(poll: float) -> None:
    """(a rank told by another) Exit after the reporter, whose blocked collective this rank's exit would fail:
    until the store is gone, at most as long as the reporter waits."""
    store, deadline = group_store(single_rank_too=True), time.monotonic() + 2 * poll + 2
    while store is not None and time.monotonic() < deadline:
        try:
            store.check([STORE_KEY])
        except Exception:  # noqa: BLE001  (the host has exited)
            return
        time.sleep(poll / 4)


def _post(message: str) -> bool:
    store = group_store(single_rank_too=True)
    try:
        if store is not None and not store.check([STORE_KEY]):
            store.set(STORE_KEY, message)
            return True
    except Exception:  # noqa: BLE001  (store gone)
        pass
    return False
