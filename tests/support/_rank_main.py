"""One rank that torchrun starts for :mod:`multirank`: ``python -m _rank_main <run folder> --call`` (the function in
``call.pkl``) or ``... --script <python argv>``.

The process torchrun starts writes ``rank<RANK>.pid`` and sends its fds 1 and 2 into ``rank<RANK>.out``/``.err``,
then forks the rank itself and waits for it: it writes how the rank ended into ``rank<RANK>.status`` (an exit code,
or minus the number of the signal that ended it, which the rank cannot record itself) and ends the same way, so
that torchrun sees what the rank did. Both are one process group, which torchrun and the timeout end as one.

:func:`forked` is the same rank as a worker of :mod:`_agent` (a child of its forkserver, SAT already imported):
it makes the process group itself, and passes on to the rank the signal torchrun sends it alone.
"""
import atexit
import json
import multiprocessing
import os
import pickle
import runpy
import signal
import sys
import traceback


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _redirect(workdir: str, rank: str) -> None:
    for fd, kind in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(workdir, f"rank{rank}.{kind}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _run(workdir: str, rank: str, argv) -> int:
    with open(os.path.join(workdir, "env.json")) as f:
        os.environ.update(json.load(f))  # the test's own values, also where torchrun set its own (LOCAL_WORLD_SIZE)
    if os.environ.get("SATP_TEST_IMPORT", "1") == "1":  # only where the test asks for it
        import sat_patches
        sat_patches.apply()  # every patch on now (SAT imported), as in a process that imported sat_patches and SAT
    if argv[0] == "--script":
        script = argv[1:]
        if script[0] == "-m":
            sys.argv = [script[1], *script[2:]]
            runpy.run_module(script[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(script)
            runpy.run_path(script[0], run_name="__main__")
        return 0
    with open(os.path.join(workdir, "call.pkl"), "rb") as f:
        target, args, kwargs = pickle.load(f)
    module_name, _, qualname = target.partition(":")
    obj = __import__(module_name, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    try:
        outcome, code = ("ok", obj(*args, **kwargs)), 0
    except BaseException:  # report, then fail the rank
        outcome, code = ("error", traceback.format_exc()), 1
        sys.stderr.write(outcome[1])
    _write(os.path.join(workdir, f"rank{rank}.result"), pickle.dumps(outcome))
    return code


def rank_main(workdir: str, rank: str, argv) -> int:
    try:
        code = _run(workdir, rank, argv)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return code


def supervise(child: int, status_file: str, forward: bool = False) -> None:
    # torchrun's SIGTERM to the group ends the rank, recorded here (``forward``: sent to this process alone)
    signal.signal(signal.SIGTERM, (lambda sig, _: os.kill(child, sig)) if forward else signal.SIG_IGN)
    status = os.waitpid(child, 0)[1]
    code = os.waitstatus_to_exitcode(status)
    _write(status_file, str(code).encode())
    if code < 0:  # the same signal (its default action) for this process
        for handled in (signal.SIGTERM, signal.SIGINT):
            signal.signal(handled, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


def start(workdir: str, forward: bool = False) -> str:
    """Record this process, send its output to the run's folder and fork the rank: returns the rank's number in the
    rank; the supervisor never returns."""
    rank = os.environ["RANK"]
    _write(os.path.join(workdir, f"rank{rank}.pid"), str(os.getpid()).encode())
    _redirect(workdir, rank)
    child = os.fork()
    if child:
        supervise(child, os.path.join(workdir, f"rank{rank}.status"), forward)
    return rank


def forked(workdir: str, *argv: str) -> None:
    """The rank as a worker of :mod:`_agent`: it ends as a multiprocessing child does (``os._exit``), after its
    atexit handlers and with its output flushed."""
    os.setsid()
    multiprocessing.set_start_method(None, force=True)  # the platform's default again, as in a new interpreter
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # an agent's handlers (forked from it) not kept
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rank = start(workdir, forward=True)
    code = rank_main(workdir, rank, argv)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    workdir = sys.argv[1]
    rank = start(workdir)
    sys.exit(rank_main(workdir, rank, sys.argv[2:]))
