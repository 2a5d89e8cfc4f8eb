"""A CPU run's steps from one interpreter:
``python -m sat_patches.runner.one_process '<JSON list of command lines>'``.

The CPU runs of the scripts prepare (``python -m sat_patches finetune prepare`` or
``python -m sat_patches.runner.checkout_cpu prepare``), train (``python -m sat_patches.runner.cpu_ranks``), then
check what training wrote (``python -m sat_patches merge``, ``... finetune verify``, ``... export hf``, or
``... checkout_cpu verify``). Each step in a fresh interpreter would import torch, SAT, DeepSpeed and bitsandbytes
again (seconds each, most of each step's time on a tiny model); here the steps that are verbs of ours run in this
interpreter, one after the other, and every other step runs as a child process, with the environment this process
started with. Each command line is printed (``+ ...``) before it runs, as the runner prints the steps it starts,
and each line can be copied and run on its own with the same result: a verb's ``main`` runs with the command
line's arguments, as ``python -m`` would run it. An argument :func:`latest_run_under` wrote names the newest
training run under a directory, found when its step starts (after training).

The ranks' launcher (:mod:`sat_patches.runner.cpu_ranks`) is forked from this process before the verbs run
(:class:`StandbyLauncher`), after the imports that the verbs and every rank make: a CPU run imports torch, SAT,
DeepSpeed and transformers once, and its printed launcher line still runs the same ranks on its own.

The verbs run here get their own ``MASTER_PORT`` (SAT's one-process group of model-only work holds its port while
the ranks train on the run's port). A step's non-zero status (or a verb's exception, printed as a fresh
interpreter prints it, status 1) stops the rest; the status is this process's.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import traceback
from typing import Dict, List, Sequence

from ..cli import exit_forked
from ..core.ports import free_port
from . import cpu_ranks

# ``python -m MODULE`` -> the module whose ``main(argv)`` that command runs
IN_PROCESS = {"sat_patches": "sat_patches.cli.main", "sat_patches.runner.checkout_cpu": "sat_patches.runner.checkout_cpu"}
_LATEST = re.compile(r"^\{the latest run under (.+)\}$")


def verb_module(cmd: Sequence[str]) -> str:
    """The module of ``main`` for a command line ``[this python, "-m", module, ...]`` that can run here, else ""."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        return IN_PROCESS.get(cmd[2], "")
    return ""


def step_line(cmd: Sequence[str]) -> str:
    return "+ " + " ".join(shlex.quote(c) for c in cmd)


def step_failed(cmd: Sequence[str], code: int) -> str:
    return f"error: step failed with exit code {code}: {cmd[0]} {' '.join(cmd[1:4])} ..."


def latest_run_under(save_dir: str) -> str:
    """An argument that stands for the newest training run (a directory with ``latest``) under ``save_dir``."""
    return "{the latest run under %s}" % save_dir


def latest_run(save_dir: str) -> str:
    """The newest training run under ``save_dir``: a directory with ``latest``, not the merged save upstream's
    demos write beside their runs (``merged_lora_<kind>``)."""
    runs = [d for d in glob.glob(os.path.join(save_dir, "*"))
            if os.path.isfile(os.path.join(d, "latest")) and not os.path.basename(d).startswith("merged_lora_")]
    if not runs:
        raise SystemExit(f"error: training wrote no checkpoint under {save_dir}")
    return max(runs, key=os.path.getmtime)


def resolved(cmd: Sequence[str]) -> List[str]:
    """``cmd`` with each :func:`latest_run_under` argument replaced by that run's directory."""
    return [latest_run(m.group(1)) if m else arg for arg, m in ((a, _LATEST.match(a)) for a in cmd)]


def command(commands: List[List[str]]) -> List[str]:
    """The command line that runs ``commands`` from one interpreter (at least one a verb :func:`verb_module`
    accepts: otherwise there is nothing to share)."""
    if not any(verb_module(cmd) for cmd in commands):
        raise ValueError(f"no verb this module runs: {commands}")
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


def run_child(cmd: Sequence[str], env: Dict[str, str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.call(list(cmd), env=env)


def own_master_port(children_port: str) -> None:
    """A ``MASTER_PORT`` for the verbs run here other than the children's (their ranks' rendezvous)."""
    port = str(free_port())
    while port == children_port:
        port = str(free_port())
    os.environ["MASTER_PORT"] = port


class StandbyLauncher:
    """The launcher of a CPU run's ranks (:mod:`sat_patches.runner.cpu_ranks`), forked from this process before
    its verbs run: this process imports what every rank imports once (its verbs need it too) and the ranks are
    forked from that state, with no second interpreter importing it all again; the verbs that run here in the
    meantime (``prepare``: a model built, a process group up, threads started) leave the launcher as it was. It
    waits for the launcher's command line (:meth:`run`), or ends unused (:meth:`close`, or this process's end)."""

    def __init__(self):
        cpu_ranks.preload()
        read_end, self._write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._write_end)
            with os.fdopen(read_end, "rb") as f:
                message = f.read()
            exit_forked(cpu_ranks.main(json.loads(message)) if message else 0)  # never returns
        os.close(read_end)

    @staticmethod
    def runs(cmd: Sequence[str]) -> bool:
        return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1:3] == ["-m", cpu_ranks.__name__]

    def run(self, cmd: Sequence[str]) -> int:
        """The launcher's status after it ran ``cmd`` (a command line :meth:`runs` accepts)."""
        sys.stdout.flush()
        sys.stderr.flush()
        with os.fdopen(self._write_end, "wb") as f:
            f.write(json.dumps(list(cmd[3:])).encode())
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        if self.pid is not None:
            os.close(self._write_end)
            os.waitpid(self.pid, 0)
            self.pid = None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m sat_patches.runner.one_process '<JSON list of command lines>'", file=sys.stderr)
        return 2
    children_env = dict(os.environ)  # as this process started: what the runner gave each step
    commands = json.loads(argv[0])
    standby = StandbyLauncher() if sum(map(StandbyLauncher.runs, commands)) == 1 else None
    own_master_port(children_env.get("MASTER_PORT", ""))
    try:
        return run_steps(commands, children_env, standby)
    finally:
        if standby is not None:
            standby.close()


def run_steps(commands: List[List[str]], children_env: Dict[str, str], standby) -> int:
    for cmd in commands:
        try:
            cmd = resolved(cmd)
        except SystemExit as exc:
            print(exc, file=sys.stderr, flush=True)
            return 1
        print(step_line(cmd), flush=True)
        if verb_module(cmd):
            code = run_one(cmd)
        elif standby is not None and StandbyLauncher.runs(cmd):
            code = standby.run(cmd)
        else:
            code = run_child(cmd, children_env)
        sys.stdout.flush()
        if code != 0:
            print(step_failed(cmd, code), file=sys.stderr, flush=True)
            return code
    return 0


if __name__ == "__main__":
    from ..cli import exit_now
    exit_now(main())
