"""Run a training script with sat_patches applied first.

    python -m sat_patches.launch SCRIPT.py ARGS...
    python -m sat_patches.launch -m package.module ARGS...
    torchrun --nproc-per-node 2 -m sat_patches.launch SCRIPT.py ARGS...
    deepspeed --module sat_patches.launch SCRIPT.py ARGS...

The patches are applied before the script imports anything, the script runs as ``__main__`` with
its own directory first on ``sys.path`` (as ``python SCRIPT.py`` would), and a ``--local_rank=N``
that the DeepSpeed launcher puts in front of the script is passed on behind it.
"""
from __future__ import annotations

import importlib.util
import io
import os
import sys
import types

import sat_patches  # noqa: F401  (arms every patch not disabled: they go on when the script imports SAT)

USAGE = "usage: python -m sat_patches.launch SCRIPT.py [ARGS...]  |  python -m sat_patches.launch -m MODULE [ARGS...]"


def split_launcher_args(argv):
    """Move leading ``--local_rank=N`` / ``--local_rank N`` (DeepSpeed launcher) behind the script."""
    moved, rest = [], list(argv)
    while rest and rest[0].startswith("--local_rank"):
        token = rest.pop(0)
        moved.append(token)
        if "=" not in token and rest:
            moved.append(rest.pop(0))
    if not rest:
        raise SystemExit(USAGE)
    if rest[0] == "-m":
        if len(rest) < 2:
            raise SystemExit(USAGE)
        return ("module", rest[1]), rest[2:] + moved
    return ("path", rest[0]), rest[1:] + moved


def main(argv=None) -> None:
    (kind, target), script_args = split_launcher_args(sys.argv[1:] if argv is None else argv)
    if kind == "module":
        spec = module_spec(target)
        sys.argv = [spec.origin, *script_args]
        run_as_main(spec.loader.get_code(spec.name), spec.origin, spec)
        return
    if not os.path.isfile(target):
        raise SystemExit(f"sat_patches.launch: no such script: {target}")
    sys.argv = [target, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    with io.open_code(target) as f:
        run_as_main(compile(f.read(), target, "exec", dont_inherit=True), target)


def module_spec(name: str):
    """The spec of what ``python -m name`` runs (a package's ``__main__``)."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(name + ".__main__")
    except ImportError:
        spec = None
    if spec is None or spec.loader is None:
        raise SystemExit(f"sat_patches.launch: no module named {name}")
    return spec


def run_as_main(code, path: str, spec=None) -> None:
    """Run ``code`` as ``python SCRIPT.py`` and ``python -m MODULE`` run it: in a module ``__main__`` that stays
    ``sys.modules["__main__"]``, whose globals the interpreter's exit clears as it clears a script's (runpy's
    temporary module would leave them to the last garbage collection, where a buffered file the script left open
    can lose what it holds, python/cpython#62052)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __spec__=spec, __loader__=spec and spec.loader,
                         __package__=spec.parent if spec else None)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def destroy_leftover_group() -> None:
    """Destroy the process group a returned script left up (one it made itself; SAT's is destroyed by an exit
    handler): left to the interpreter's teardown, gloo's threads can abort the finished rank (``terminate called
    without an active exception``, pytorch/pytorch#190489)."""
    if "torch.distributed" in sys.modules:  # (a script that never imported it made no group)
        from sat_patches.runtime.distributed import destroy_group_at_exit  # (imports torch and SAT: only then)
        destroy_group_at_exit()


if __name__ == "__main__":
    main()
    destroy_leftover_group()
