"""Several of the scripts' steps in one interpreter:
``python -m sat_patches.runner.one_process '<JSON list of command lines>'``.

The CPU demo ends with ``python -m sat_patches.merge``, ``python -m sat_patches.finetune verify`` and
``python -m sat_patches.export hf``: one after the other, none in a distributed job. Each in a fresh interpreter
would import torch, SAT, DeepSpeed and bitsandbytes again (seconds each, most of each step's time on a tiny
model); here they share one interpreter. Each command line is printed (``+ ...``) before its verb runs, as the
runner prints the steps it starts, and each line can be copied and run on its own with the same result: the
verb's ``main`` runs with the command line's arguments, as ``python -m`` would run it.

A verb's non-zero status (or an exception, printed as a fresh interpreter prints it, status 1) stops the
rest; the status is this process's.
"""
from __future__ import annotations

import importlib
import json
import shlex
import sys
import traceback
from typing import List, Sequence

# ``python -m MODULE`` -> the module whose ``main(argv)`` that command runs
IN_PROCESS = {"sat_patches.merge": "sat_patches.cli.merge", "sat_patches.finetune": "sat_patches.cli.finetune",
              "sat_patches.export": "sat_patches.cli.export"}


def verb_module(cmd: Sequence[str]) -> str:
    """The module of ``main`` for a command line ``[this python, "-m", module, ...]`` that can run here, else ""."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        return IN_PROCESS.get(cmd[2], "")
    return ""


def step_line(cmd: Sequence[str]) -> str:
    return "+ " + " ".join(shlex.quote(c) for c in cmd)


def step_failed(cmd: Sequence[str], code: int) -> str:
    return f"error: step failed with exit code {code}: {cmd[0]} {' '.join(cmd[1:4])} ..."


def command(commands: List[List[str]]) -> List[str]:
    """The command line that runs ``commands`` (each one :func:`verb_module` accepts) in one interpreter."""
    if not all(verb_module(cmd) for cmd in commands):
        raise ValueError(f"not a verb this module runs: {commands}")
    return [sys.executable, "-m", "sat_patches.runner.one_process", json.dumps(commands)]


def run_one(cmd: Sequence[str]) -> int:
    main = importlib.import_module(verb_module(cmd)).main
    try:
        code = main(list(cmd[3:]))
    except SystemExit as exc:  # argparse and the verbs' own exits
        code = exc.code
    except Exception:  # noqa: BLE001 (printed as an uncaught exception is, with the status a fresh process has)
        traceback.print_exc()
        code = 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # SystemExit("message"): printed, status 1
    return 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m sat_patches.runner.one_process '<JSON list of command lines>'", file=sys.stderr)
        return 2
    for cmd in json.loads(argv[0]):
        print(step_line(cmd), flush=True)
        code = run_one(cmd)
        sys.stdout.flush()
        if code != 0:
            print(step_failed(cmd, code), file=sys.stderr, flush=True)
            return code
    return 0


if __name__ == "__main__":
    from ..cli import exit_now
    exit_now(main())
