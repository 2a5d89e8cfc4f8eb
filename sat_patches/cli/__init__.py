"""The ``sat-patches`` command, one module per verb."""
import atexit
import os
import sys


def exit_now(code) -> None:
    """Exit a verb's process (``python -m sat_patches.merge`` and the like) with ``code`` as soon as its work is
    done: output flushed, then ``os._exit``, without the interpreter's teardown, which after SAT, torch and a built
    model takes seconds (measured: 10 s of a 21 s ``finetune prepare`` on a loaded 2-core machine) and writes
    nothing. Every file a verb writes is closed before it returns. A process in a distributed job (a rank that
    still has its process group) exits normally, so the group is torn down as torch expects. A process alone in
    its group (the one-process group SAT makes for model-only work, as ``merge`` has) is no such job: its exit
    handlers run (the group destroyed, a save lock given back), then the same quick exit."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            sys.exit(code)
        atexit._run_exitfuncs()  # what a normal exit runs first; the teardown after it is what is skipped
    code = code if isinstance(code, int) else (0 if code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
