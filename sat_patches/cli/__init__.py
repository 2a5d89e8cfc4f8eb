"""The ``sat-patches`` command, one module per verb."""
import atexit
import gc
import io
import os
import sys
import threading

from ..core import settings


def exit_now(code) -> None:
    """Exit a verb's process (``python -m sat_patches.merge`` and the like) with ``code`` as soon as its work is
    done: output flushed, then ``os._exit``, without the interpreter's teardown, which after SAT, torch and a built
    model takes seconds (measured: 10 s of a 21 s ``finetune prepare`` on a loaded 2-core machine) and writes
    nothing. Every file a verb writes is closed before it returns. A process in a distributed job (a rank that
    still has its process group) exits normally, so the group is torn down as torch expects. A process alone in
    its group (the one-process group SAT makes for model-only work, as ``merge`` has) is no such job: its exit
    handlers run (the group destroyed, a save lock given back), then the same quick exit."""
    if _group_initialized():
        if sys.modules["torch.distributed"].get_world_size() > 1:
            sys.exit(code)
        atexit._run_exitfuncs()  # what a normal exit runs first; the teardown after it is what is skipped
    _flush_and_exit(code if isinstance(code, int) else (0 if code is None else 1))


def exit_after_script() -> None:
    """Exit a rank whose training script (``python -m sat_patches.launch``) returned: every file it left open is
    flushed (the interpreter's teardown can drop what a buffered file in a reference cycle holds, python/cpython#62052),
    the exit handlers run (the process group destroyed, tensorboard's and wandb's writers closed), then
    ``os._exit(0)`` without the teardown of torch, SAT and the model (about 1-2 s a rank on a 2-core machine). A
    group the script created itself, not through SAT (whose group the handlers destroy), is destroyed here too:
    left to the teardown, gloo's threads can abort the process after the work is done (``terminate called without
    an active exception``, pytorch/pytorch#190489). A normal exit after the flush where it could matter: a thread
    other than daemons still running (a writer the script started); ``SAT_PATCHES_QUICK_EXIT=0`` always."""
    _flush_open_files()
    if not settings.read("SAT_PATCHES_QUICK_EXIT") or _other_threads():
        return
    atexit._run_exitfuncs()
    if _group_initialized():
        sys.modules["torch.distributed"].destroy_process_group()
    _flush_open_files()  # (what the exit handlers wrote)
    _flush_and_exit(0)


def exit_forked(code) -> None:
    """End a process forked from another one's code (a rank of :mod:`sat_patches.runner.cpu_ranks`) as ``python``
    ends, without returning into the code it was forked from: ``code`` as ``SystemExit`` gives it (a message:
    printed, status 1), after the threads the script left running finished, the exit handlers ran and every open
    file was flushed; the interpreter's teardown, which writes nothing, is skipped."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for thread in _other_threads():
        thread.join()
    atexit._run_exitfuncs()
    _flush_open_files()
    _flush_and_exit(code or 0)


def _flush_open_files() -> None:
    # one subclass check per type, not an ``isinstance`` against the ABC per object: a rank after training
    # holds hundreds of thousands of objects (0.3-0.7 s a call with ``isinstance``)
    is_file = {}
    for obj in gc.get_objects():
        kind = type(obj)
        found = is_file.get(kind)
        if found is None:
            found = is_file[kind] = issubclass(kind, io.IOBase)
        if found and obj not in (sys.stdout, sys.stderr):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass


def _other_threads() -> list:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def _group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
