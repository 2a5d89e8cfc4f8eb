"""The fork server ("zygote") of zygote.py (tests/support): one long-lived process that has
imported torch, SAT, DeepSpeed and bitsandbytes once, and forks a rank for each request.

Started as ``python -c <loader> <this file> <address> [<preload>]`` so that the ``sat_patches`` package is
*not* imported here (importing it applies the patches, which must happen in each rank according to that rank's
environment). Standard library only, apart from the preloaded modules.

One server serves every test process of a session that has the same import-time environment (the xdist workers):
it listens on an abstract Unix socket (``\\0<address>``, no file; gone with the process), which it binds *before*
its imports, so that of two servers started at once for one address the second stops at once (exit status
:data:`LOST`) instead of importing everything a second time; clients see "connection refused" until the first
listens.

Protocol, per connection: each message is a 4-byte big-endian length and a pickle.

* server -> client, on connecting: ``("ready", pid, preloaded modules, the server's environment)``.
* client -> server: ``{"id", "cmd", "env", "cwd", "stdout", "stderr"}`` where ``cmd`` is
  ``[python, "-m", module, *args]`` or ``[python, "-c", code, *args]``; the answer is ``("spawned", id, pid)`` or
  ``("spawn_failed", id, reason)``, and later ``("exit", id, code)`` (by the client's request id: pids get
  reused) with ``code`` from :func:`os.waitstatus_to_exitcode` (``-N`` for signal N, as :class:`subprocess.Popen`
  reports).
* End of file from a client: SIGKILL the process group of each of its ranks still running.
* No client and no rank for :data:`GRACE` seconds: the server stops listening and exits.

The zygote stays single-threaded (a ``select`` loop over its sockets, ``waitpid(-1, WNOHANG)`` while ranks
live): forking a process with other threads would copy held locks into the child.
"""
import gc
import importlib.util
import os
import pickle
import select
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback

PRELOAD = ("torch", "torch.distributed", "sat", "deepspeed",
           "sat.model.finetune.lora2",  # SAT's LoRA module is what imports bitsandbytes
           "torch._dynamo",  # what activation checkpointing and torch.optim import in a rank (2-3 s): once, here
           "matplotlib.pyplot")  # what the rank that logs a run's loss imports to draw its curve (0.6 s)
# (a comma-separated list after the two fds replaces it: see zygote.BEFORE_SAT)
# torch.compile deferred to a function's first call, loaded by its path (the sat_patches package stays unimported)
COMPILER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "sat_patches", "runtime", "compiler.py")
POLL = 0.02  # seconds between reaps while ranks run
GRACE = 3.0  # seconds without a client or a rank before the server exits
LOST = 3  # exit status of a server whose address another server holds already


def log_path(address: str) -> str:
    """Where the server at ``address`` writes its output (its first client opens it; the server removes it)."""
    return os.path.join(tempfile.gettempdir(), address + ".log")


def _send(fd, message) -> None:
    data = pickle.dumps(message)
    data = struct.pack("!I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _receive(fd):
    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack("!I", head)[0])
    return None if body is None else pickle.loads(body)


def _exit_code_of(exc: SystemExit, stderr) -> int:
    """What the interpreter makes of an uncaught ``SystemExit``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def _run_as_python(cmd) -> int:
    """In a fresh fork: behave like ``python -m module args`` (runpy's own entry for ``-m``) or
    ``python -c code args`` from here on; an exception escaping the module is handled as the
    interpreter would: traceback or ``SystemExit`` code, then non-daemon threads joined and atexit
    callbacks run."""
    import runpy
    flag, target, args = cmd[1], cmd[2], list(cmd[3:])
    sys.argv = [flag, *args]  # runpy puts the module's file name in argv[0], as -m does
    try:
        if flag == "-m":
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            main = sys.modules["__main__"]
            main.__dict__.clear()
            main.__dict__.update(__name__="__main__", __builtins__=__builtins__)
            exec(compile(target, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as exc:
        code = _exit_code_of(exc, sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        import threading
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    return code


def _child(request, sockets) -> None:
    """The forked rank. Never returns: ends with ``os._exit``."""
    code = 1
    try:
        os.setsid()  # own process group: the client kills the rank and its children with killpg
        for sock in sockets:
            sock.close()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # sys.stdout/sys.stderr (and every logging handler bound to them at import) write to fds 1/2
        for src, dst in ((null, 0), (out, 1), (err, 2)):
            os.dup2(src, dst)
            os.close(src)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # what ``python -m`` puts first: the working directory
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
            sys.modules["numpy"].random.seed()
        code = _run_as_python(request["cmd"])
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code & 0xFF)


def kill_rank(pid: int) -> None:
    """SIGKILL a forked rank and what it started: its process group, made by the rank's first act (``setsid``); a
    rank forked a moment ago may not have run yet, and then it is killed by its pid (it has started nothing). The
    caller has not reaped ``pid``, so the number is still the rank's."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def import_bitsandbytes_as_patched() -> None:
    """bitsandbytes as a patched rank imports it, its kernels compiled at their first call (a plain import loads
    torch's compiler for them: 2-3 s of every server's start, which a rank needs only for QLoRA's kernels)."""
    spec = importlib.util.spec_from_file_location("_satp_zygote_compiler", COMPILER)
    compiler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compiler)
    with compiler.compiler_deferred():
        import bitsandbytes  # noqa: F401


def serve(address: str, preload=PRELOAD) -> int:
    environment = dict(os.environ)  # as started: what clients compare their ranks' environments with
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + address)
    except OSError:  # another server has this address: its clients are ours
        return LOST
    if "bitsandbytes" in preload or "sat.model.finetune.lora2" in preload:
        import_bitsandbytes_as_patched()
    for name in preload:
        __import__(name)
    if "sat_patches" in sys.modules:
        raise RuntimeError("the preload imported sat_patches; ranks would not start unpatched")
    # the preloaded heap (torch, SAT, ...) moves to the collector's permanent generation: a forked rank's
    # collections skip it instead of walking millions of objects each (and leave its pages shared)
    gc.freeze()
    listener.listen(64)
    ready = ("ready", os.getpid(), sorted(preload), environment)
    clients = set()
    live = {}  # pid -> (the client that asked for it, its request id)
    try:
        _loop(listener, ready, clients, live)
    finally:
        listener.close()
        for pid in live:  # leave no rank behind
            kill_rank(pid)
        for pid in live:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    try:
        os.unlink(log_path(address))
    except OSError:
        pass
    return 0


def _drop(client, clients: set, live: dict) -> None:
    """A client went away: its ranks are killed (their exits are reaped and dropped)."""
    clients.discard(client)
    client.close()
    for pid, (owner, _) in live.items():
        if owner is client:
            kill_rank(pid)


def _tell(client, message, clients: set, live: dict) -> None:
    if client in clients:
        try:
            _send(client.fileno(), message)
        except OSError:
            _drop(client, clients, live)


def _loop(listener, ready, clients: set, live: dict) -> None:
    alone_since = time.monotonic()
    while True:
        readable, _, _ = select.select([listener, *clients], [], [], POLL if live else GRACE)
        for sock in readable:
            if sock is listener:
                client, _ = listener.accept()
                clients.add(client)
                _tell(client, ready, clients, live)
                continue
            try:
                request = _receive(sock.fileno())
            except OSError:
                request = None
            if request is None:
                _drop(sock, clients, live)
                continue
            sys.stdout.flush(), sys.stderr.flush()  # nothing buffered may be copied into the child
            try:
                pid = os.fork()
            except OSError as exc:
                _tell(sock, ("spawn_failed", request["id"], repr(exc)), clients, live)
                continue
            if pid == 0:
                _child(request, [listener, *clients])
            live[pid] = (sock, request["id"])
            _tell(sock, ("spawned", request["id"], pid), clients, live)
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            owner, request_id = live.pop(pid)
            _tell(owner, ("exit", request_id, os.waitstatus_to_exitcode(status)), clients, live)
        if clients or live:
            alone_since = time.monotonic()
        elif time.monotonic() - alone_since >= GRACE and not select.select([listener], [], [], 0)[0]:
            return


if __name__ == "__satp_zygote__":  # run by the loader in zygote.py: argv is [-c, this file, address, preload?]
    sys.exit(serve(sys.argv[2], *([sys.argv[3].split(",")] if len(sys.argv) > 3 else [])))
