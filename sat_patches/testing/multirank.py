"""Run a function or a script on N local ranks (one process each) with a hard timeout.

Every rank gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT on loopback) and ``OMP_NUM_THREADS=1``. ``patches`` selects what each rank
imports first: ``True`` (every patch), ``"stock"`` (stock SAT plus only the CPU stand-ins a GPU
user does not need: see :data:`CPU_STANDINS`), or an iterable of patch names to disable.

Each rank is a fresh ``python -m sat_patches.testing._rank_main`` process, unless a faster starter was set
with :func:`set_rank_starter` (this project's test suite forks ranks from a server that has imported
torch/SAT/DeepSpeed once). Both kinds are started in their own session, timed out and killed alike;
``RankResult.forked`` tells which it was.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Union

import sat_patches

from ..core.ports import free_port
from ..core.rank_env import torchrun_variables

# Stand-ins for what a GPU machine has (triton, a CUDA rotary kernel); kept in "stock" runs so that
# stock SAT can be imported and run on CPU at all.
CPU_STANDINS = ("triton_rotary_import", "rotary_torch_fallback")


def stock_disable() -> List[str]:
    return [n for n in sat_patches.names() if n not in CPU_STANDINS]


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    result: Any = None
    timed_out: bool = False
    exception: Optional[str] = None
    forked: bool = False                 # forked from the fork server (False: a fresh process)
    fresh_reason: Optional[str] = None   # why it was not forked

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out



def _patch_env(patches) -> dict:
    if patches is True:
        return {"SAT_PATCHES_IMPORT": "1", "SAT_PATCHES_DISABLE": ""}
    if patches == "stock":
        return {"SAT_PATCHES_IMPORT": "1", "SAT_PATCHES_DISABLE": ",".join(stock_disable())}
    if patches is False or patches is None:
        return {"SAT_PATCHES_IMPORT": "0", "SAT_PATCHES_DISABLE": ""}
    return {"SAT_PATCHES_IMPORT": "1", "SAT_PATCHES_DISABLE": ",".join(patches)}


# (cmd, env, stdout path, stderr path, base env, fresh) -> (a started process, None) or (None, why not)
RankStarter = Callable[[List[str], dict, str, str, dict, bool], tuple]
_starter: Optional[RankStarter] = None


def set_rank_starter(starter: Optional[RankStarter]) -> None:
    """Start ranks with ``starter`` where it can (it returns ``(process, None)``, or ``(None, reason)`` for a
    fresh process); None: every rank a fresh process."""
    global _starter
    _starter = starter


def _launch(cmds: Sequence[List[str]], envs: Sequence[dict], timeout: float, workdir: str,
            fresh: bool = False) -> List[RankResult]:
    procs, files, reasons = [], [], []
    base = _base_env()
    for rank, (cmd, env) in enumerate(zip(cmds, envs)):
        out = open(os.path.join(workdir, f"rank{rank}.out"), "w+")
        err = open(os.path.join(workdir, f"rank{rank}.err"), "w+")
        files.append((out, err))
        forked, reason = (_starter(cmd, env, out.name, err.name, base, fresh) if _starter
                          else (None, "no rank starter set"))
        reasons.append(reason)
        procs.append(forked or subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True))
    deadline = time.monotonic() + timeout
    timed_out = [False] * len(procs)
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out[i] = True
    for i, p in enumerate(procs):  # whoever is left when the deadline passed
        if p.poll() is None:
            timed_out[i] = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0), err.seek(0)
        results.append(RankResult(rank, p.returncode, out.read(), err.read(), timed_out=timed_out[rank],
                                  forked=reasons[rank] is None, fresh_reason=reasons[rank]))
        out.close(), err.close()
    return results


def _base_env() -> dict:
    """What every rank's environment starts from (and the fork server is started with)."""
    e = dict(os.environ)
    e.update({
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
        "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
    })
    for key in ("SAT_PATCHES_DISABLE", "SAT_PATCHES_IMPORT"):  # each rank sets its own
        e.pop(key, None)
    return e


def _rank_env(rank: int, nranks: int, port: int, patches, env: Optional[dict], nodes: int = 1) -> dict:
    """A rank's environment: torchrun's variables (:func:`torchrun_variables`; ``nodes`` > 1 as
    ``torchrun --nnodes`` lays the ranks out), the patches it imports, then ``env``."""
    e = _base_env()
    e.update(torchrun_variables(rank, nranks, port, nodes))
    e.update(_patch_env(patches))
    if env:
        e.update({k: str(v) for k, v in env.items()})
    return e


def run_ranks(fn: Union[Callable, str], nranks: int = 2, args: tuple = (), kwargs: Optional[dict] = None,
              timeout: float = 120, patches: Any = True, env: Optional[dict] = None,
              fresh: bool = False, nodes: int = 1) -> List[RankResult]:
    """Call ``fn(*args, **kwargs)`` on ``nranks`` processes; returns one :class:`RankResult` per rank.
    ``fresh=True``: fresh processes, not forked from the fork server. ``nodes``: the ranks laid out on that many
    nodes as ``torchrun --nnodes`` lays them out (see :func:`_rank_env`), all on this machine.

    ``fn`` is a module-level function or ``"module:function"``. Its return value (picklable) is
    ``result``; an exception it raises is ``exception`` (formatted traceback) and exit code 1.
    """
    target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="satp-ranks-") as workdir:
        payload = os.path.join(workdir, "payload.pkl")
        with open(payload, "wb") as f:
            pickle.dump((target, args, kwargs or {}), f)
        cmds, envs = [], []
        for rank in range(nranks):
            result_file = os.path.join(workdir, f"result{rank}.pkl")
            cmds.append([sys.executable, "-m", "sat_patches.testing._rank_main", payload, result_file])
            envs.append(_rank_env(rank, nranks, port, patches, env, nodes))
        results = _launch(cmds, envs, timeout, workdir, fresh=fresh)
        for r in results:
            path = os.path.join(workdir, f"result{r.rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    kind, value = pickle.load(f)
                if kind == "ok":
                    r.result = value
                else:
                    r.exception = value
    return results


def run_script(argv: Sequence[str], nranks: int = 2, timeout: float = 300, patches: Any = True,
               env: Optional[dict] = None, cwd: Optional[str] = None, fresh: bool = False) -> List[RankResult]:
    """Run ``python <argv>`` (a script path or ``-m module``) on ``nranks`` ranks (``fresh``: as in
    :func:`run_ranks`)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="satp-ranks-") as workdir:
        cmds = [[sys.executable, "-m", "sat_patches.testing._rank_main", "--script", *argv]
                for _ in range(nranks)]
        envs = [_rank_env(rank, nranks, port, patches, env) for rank in range(nranks)]
        if cwd:
            for e in envs:
                e["SAT_PATCHES_CWD"] = cwd
        return _launch(cmds, envs, timeout, workdir, fresh=fresh)
