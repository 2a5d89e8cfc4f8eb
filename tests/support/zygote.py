"""Fork server for :mod:`sat_patches.testing.multirank`: ranks forked from one process that has
already imported torch, SAT, DeepSpeed and bitsandbytes, instead of paying those imports (6-9 s)
in every fresh ``python -m sat_patches.testing._rank_main`` process.

The server (``_zygote_server.py``) starts lazily, on the first launch that can use it, with the
base environment every rank gets (:func:`multirank._base_env`). The test processes of one session (pytest-xdist's
workers, whose import-time environments are the same) share one server for each preload: the first to need it
starts it, the others connect to it (:func:`address`); it exits a few seconds after its last client. It
does not import ``sat_patches``: each forked rank imports it itself, after its own environment is in
place, so ``SAT_PATCHES_DISABLE`` and the rest apply per rank as in a fresh process. A forked rank
runs the very command line a fresh one would (``python -m sat_patches.testing._rank_main ...``,
through runpy as ``-m`` does) in its own session, stdin from /dev/null, stdout/stderr on the
rank's files. :class:`ForkedRank` answers ``pid``/``poll``/``wait``/``returncode`` like
:class:`subprocess.Popen`, so the launcher kills (``os.killpg``) and times out both kinds alike.

When a rank gets a fresh process instead (:func:`fresh_reason` decides; ``RankResult.forked`` and
``RankResult.fresh_reason`` tell afterwards):

* the caller asks for it: ``fresh=True`` on ``run_ranks``/``run_script``, or
  ``SAT_PATCHES_TEST_FRESH=1`` in the environment (every rank, for debugging);
* the server could not start, died, or refused the fork;
* the command is not ``python -m module ...`` with this interpreter;
* the rank's environment changes what happens at import time, which a fork cannot redo:

  - ``SAT_PATCHES_DISABLE`` names ``triton_rotary_import`` or ``all``: the start-up hook then does
    not serve SAT's triton module, and ``import sat`` must fail as on a machine without triton;
  - ``SAT_PATCHES_IMPORT`` other than ``1``: such a run asks for nothing of ours up front, so it
    gets a process in which nothing was imported before its code runs;
  - any variable whose name starts with one of :data:`IMPORT_TIME_PREFIXES` (the interpreter's
    ``PYTHON*``, thread pools, the dynamic loader and allocator, torch/DeepSpeed/Hugging
    Face/bitsandbytes settings, SAT's log level, the temp and cache directories) differs from the
    server's value. If the *base* environment itself changed that way (``sys.path`` grew, so
    ``PYTHONPATH`` did), the server is restarted with the new one instead, at most
    :data:`MAX_RESTARTS` times.

Everything else (``RANK``, ``MASTER_PORT``, ``SAT_PATCHES_*`` knobs, a test's own variables) is
only read at run time and is simply the forked rank's ``os.environ``.

What a fork cannot give: forked ranks share the server's string-hash secret (fresh processes each
draw their own), so an iteration order over a set of strings is the same on every forked rank; code
whose collectives could depend on such an order is checked with ``SAT_PATCHES_TEST_FRESH=1``. Import
-time messages (DeepSpeed's accelerator line, bitsandbytes' kernel notice) are printed once into the
server's log, not into each rank's output. numpy's global generator is reseeded in each fork, and
Python's ``random`` reseeds itself after a fork.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence
from sat_patches.core import settings

from _zygote_server import LOST, kill_rank, log_path  # the server's own module: standard library only at import

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote_server.py")
LOADER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__satp_zygote__')"
FRESH_ENV = "SAT_PATCHES_TEST_FRESH"
READY_TIMEOUT = 300.0   # the server's imports; a loaded 2-core machine takes 15 s
MAX_RESTARTS = 3
IMPORT_TIME_PREFIXES = (
    "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "LD_", "MALLOC_", "GLIBC_TUNABLES",
    "TORCH", "PYTORCH_", "CUDA_", "DS_", "DEEPSPEED", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "BNB_",
    "TRITON", "SAT_LOGLEVEL", "LOGLEVEL", "USE_XFORMERS", "TMPDIR", "HOME", "XDG_",
)


def forced_fresh() -> bool:
    return settings.read(FRESH_ENV)


def fresh_reason(env: Dict[str, str], server_env: Dict[str, str]) -> Optional[str]:
    """Why a rank with environment ``env`` cannot be forked from a server started with
    ``server_env`` (see the module docstring), or None when it can."""
    disabled = {n.strip() for n in env.get("SAT_PATCHES_DISABLE", "").split(",")}
    named = sorted({"triton_rotary_import", "all"} & disabled)
    if named:
        return f"SAT_PATCHES_DISABLE names {named[0]} (import sat must run without the triton stand-in)"
    if env.get("SAT_PATCHES_IMPORT", "1") != "1":
        return "SAT_PATCHES_IMPORT is not 1 (nothing may be imported before the rank's code)"
    for key in sorted(set(env) | set(server_env)):
        if key.startswith(IMPORT_TIME_PREFIXES) and env.get(key) != server_env.get(key):
            return f"{key} differs from the fork server's (read at import time)"
    return None


def _module_command(cmd: Sequence[str]) -> bool:
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m"


class ForkedRank:
    """A rank forked by the server, with the parts of :class:`subprocess.Popen` the launcher uses.

    The server, not this process, reaps the rank. :meth:`poll` reads every exit report first, so
    ``os.killpg(pid)`` after ``poll() is None`` can only miss when the rank was reaped in the few
    milliseconds since and its pid already reused, which the kernel's pid cycling makes negligible."""

    def __init__(self, server: "ForkServer", request_id: int, pid: int, args):
        self._server, self._id, self.pid, self.args = server, request_id, pid, list(args)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._server.pump(0)
            self.returncode = self._server.exits.pop(self._id, None)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if self._server.dead:
                raise RuntimeError(f"the fork server exited while rank pid {self.pid} ran")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._server.pump(left)
        return self.returncode


def address(env: Dict[str, str], preload: Optional[Sequence[str]] = None) -> str:
    """The abstract socket name of the server for ``env`` and ``preload``: one per test session (the xdist
    workers share ``PYTEST_XDIST_TESTRUNUID``; a run without workers has its own), interpreter, server code,
    preload and import-time environment, so a client reaches only a server whose imports are what its ranks
    need."""
    session = env.get("PYTEST_XDIST_TESTRUNUID") or f"process-{os.getpid()}"
    import_time = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES))
    text = repr((session, sys.executable, SERVER, tuple(preload or ()), import_time))
    return "satp-zygote-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _connect(name: str) -> Optional[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    return sock


def _unbound(name: str) -> bool:
    """No server holds the address (one that lost it to another, which then died in its imports, leaves it free)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind("\0" + name)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class ForkServer:
    """Client side of one server: connect (starting the server when none listens), spawn, collect exit codes,
    disconnect."""

    def __init__(self, env: Dict[str, str], preload: Optional[Sequence[str]] = None):
        self.exits: Dict[int, int] = {}  # request id -> exit code
        self.dead = False
        self._replies: Dict[int, object] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._owner = os.getpid()
        self.name = address(env, preload)
        self.log = log_path(self.name)
        self._sock = self._connect_or_start(env, preload)
        self._fd = self._sock.fileno()
        message = self._read(READY_TIMEOUT)
        if not (isinstance(message, tuple) and message[0] == "ready"):
            self.close()
            raise RuntimeError(f"fork server did not answer: {message!r}\n{self._log_tail()}")
        self.pid, self.preloaded, self.env = message[1], message[2], message[3]

    def _connect_or_start(self, env: Dict[str, str], preload) -> socket.socket:
        """A connection to the server at :attr:`name`, started here when none listens. Two clients may start one
        at once: the second server finds the address taken and exits (:data:`LOST`), and both clients connect to
        the first once it listens (after its imports)."""
        started = None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            sock = _connect(self.name)
            if sock is not None:
                return sock
            ended = None if started is None else started.poll()
            if started is None or (ended == LOST and _unbound(self.name)):
                with open(self.log, "ab") as log:
                    started = subprocess.Popen([sys.executable, "-c", LOADER, SERVER, self.name,
                                                *([",".join(preload)] if preload else [])],
                                               env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                               start_new_session=True)
            elif ended not in (None, LOST):
                raise RuntimeError(f"fork server did not start (exit {ended}):\n{self._log_tail()}")
            time.sleep(0.05)
        if started is not None and started.poll() is None:
            started.kill()
        raise RuntimeError(f"fork server did not listen within {READY_TIMEOUT:.0f} s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def _read(self, timeout: Optional[float]):
        """One message from the server; None on timeout; marks the server dead on end of file."""
        if self.dead:
            return None
        readable, _, _ = select.select([self._fd], [], [], timeout)
        if not readable:
            return None
        head = self._read_exact(4)
        body = None if head is None else self._read_exact(struct.unpack("!I", head)[0])
        if body is None:
            self.dead = True
            return None
        return pickle.loads(body)

    def _read_exact(self, n: int) -> Optional[bytes]:
        chunks = []
        while n:
            try:
                chunk = os.read(self._fd, n)
            except OSError:  # the connection was reset: the server is gone
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def pump(self, timeout: Optional[float]) -> None:
        """Take in what the server sent; wait up to ``timeout`` for the first message."""
        with self._lock:
            message = self._read(timeout)
            while message is not None:
                kind = message[0]
                if kind == "exit":
                    self.exits[message[1]] = message[2]
                elif kind in ("spawned", "spawn_failed"):
                    self._replies[message[1]] = message
                message = self._read(0)

    def spawn(self, cmd: Sequence[str], env: Dict[str, str], stdout: str, stderr: str) -> ForkedRank:
        with self._lock:
            if self.dead:
                raise RuntimeError("the fork server is gone")
            self._next_id += 1
            rid = self._next_id
            data = pickle.dumps({"id": rid, "cmd": list(cmd), "env": dict(env), "cwd": os.getcwd(),
                                 "stdout": stdout, "stderr": stderr})
            data = struct.pack("!I", len(data)) + data
            try:
                while data:
                    data = data[os.write(self._fd, data):]
            except OSError as exc:
                self.dead = True
                raise RuntimeError(f"the fork server is gone: {exc!r}") from exc
            while rid not in self._replies:
                if self.dead:
                    raise RuntimeError("the fork server exited before forking")
                self.pump(None)
            reply = self._replies.pop(rid)
            if reply[0] != "spawned":
                raise RuntimeError(f"the fork server could not fork: {reply[2]}")
            return ForkedRank(self, rid, reply[2], cmd)

    def close(self) -> None:
        """Disconnect: the server kills what this client still runs, and exits when no client is left."""
        if os.getpid() != self._owner:
            return
        self.dead = True
        self._sock.close()


# What a server for code that must run before ``import sat`` preloads: SAT's heavy third-party
# imports (6 of SAT's 7 s of import time), but neither SAT nor sat_patches.
BEFORE_SAT = ("torch", "torch.distributed", "deepspeed", "bitsandbytes", "transformers", "datasets")

_servers: Dict[Optional[tuple], ForkServer] = {}  # preload (None: the rank server's) -> server
_failures: Dict[Optional[tuple], str] = {}
_restarts = 0
_guard = threading.Lock()


def server_for(base_env: Dict[str, str], preload: Optional[Sequence[str]] = None) -> Optional[ForkServer]:
    """The session's server for ``preload`` (None: torch, SAT, DeepSpeed, bitsandbytes), started (or
    restarted for a changed base environment) on demand; None when it cannot be had (the reason is
    in :func:`failure`)."""
    global _restarts
    key = tuple(preload) if preload else None
    with _guard:
        server = _servers.get(key)
        if server is not None and server._owner != os.getpid():
            server = None  # a forked copy of the parent does not own the parent's server
        if server is not None and (server.dead or fresh_reason(base_env, server.env)):
            if _restarts >= MAX_RESTARTS:
                return server if not server.dead else None
            _restarts += 1
            server.close()
            server = None
        if server is None and key not in _failures:
            try:
                server = ForkServer(base_env, preload)
            except Exception as exc:  # noqa: BLE001 (any failure: fall back to fresh processes)
                _failures[key] = str(exc)
        if server is None:
            _servers.pop(key, None)
        else:
            _servers[key] = server
        return server


def failure(preload: Optional[Sequence[str]] = None) -> Optional[str]:
    return _failures.get(tuple(preload) if preload else None)


def shutdown() -> None:
    with _guard:
        for server in _servers.values():
            server.close()
        _servers.clear()


atexit.register(shutdown)


def start(cmd: List[str], env: Dict[str, str], stdout: str, stderr: str, base_env: Dict[str, str],
          fresh: bool = False):
    """Fork ``cmd`` from the server when the rule allows. Returns ``(ForkedRank, None)`` or
    ``(None, reason)`` when the caller must start a fresh process."""
    if fresh:
        return None, "fresh=True"
    if forced_fresh():
        return None, f"{FRESH_ENV}=1"
    if not _module_command(cmd):
        return None, "not a 'python -m module' command"
    reason = fresh_reason(env, base_env)
    if reason:
        return None, reason
    server = server_for(base_env)
    if server is None:
        return None, f"no fork server: {failure()}"
    reason = fresh_reason(env, server.env)
    if reason:
        return None, reason
    try:
        return server.spawn(cmd, env, stdout, stderr), None
    except RuntimeError as exc:
        return None, str(exc)


def run_before_sat(code: str, env: Optional[Dict[str, str]] = None, timeout: float = 300
                   ) -> subprocess.CompletedProcess:
    """``python -c code`` where neither SAT nor sat_patches has been imported yet, as in a fresh
    interpreter, but forked from a server that holds SAT's third-party imports (:data:`BEFORE_SAT`):
    about 1 s instead of 7. For checks of what ``import sat_patches``/``import sat`` do in either
    order. Not for checks of those third-party imports themselves (their import-time output, or that
    something did not import torch): those need :func:`subprocess.run`. A fresh process is used
    where the rule of :func:`fresh_reason` says so, or when no server can be had."""
    base = dict(os.environ)
    run_env = dict(base, **(env or {}))
    cmd = [sys.executable, "-c", code]
    server = None if forced_fresh() or fresh_reason(run_env, base) else server_for(base, BEFORE_SAT)
    if server is None or fresh_reason(run_env, server.env):
        return subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="satp-before-sat-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        proc = server.spawn(cmd, run_env, out, err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_rank(proc.pid)
            proc.wait()
            raise
        with open(out, errors="replace") as o, open(err, errors="replace") as e:
            return subprocess.CompletedProcess(cmd, proc.returncode, o.read(), e.read())
