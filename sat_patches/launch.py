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

import os
import runpy
import sys

import sat_patches  # noqa: F401  (arms every patch not disabled: they go on when the script imports SAT)
from sat_patches.cli import exit_after_script

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
        sys.argv = [target, *script_args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(target):
        raise SystemExit(f"sat_patches.launch: no such script: {target}")
    sys.argv = [target, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
    exit_after_script()  # the script returned: its rank exits without the interpreter's teardown
