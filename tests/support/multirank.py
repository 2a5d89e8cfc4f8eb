"""Run a function or a script on N local CPU ranks started by torchrun, with a hard timeout (counted from when every rank has started).

Each run starts ``python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1 --master-port P
-m _rank_main ...`` (``nodes`` > 1: one torchrun per node, with ``--nnodes`` and ``--node-rank``), so every
rank has the environment torchrun gives its workers and ``OMP_NUM_THREADS=1``. ``patches`` selects what each rank
imports first: ``True`` (every patch), ``"stock"`` (stock SAT plus only the CPU stand-ins a GPU user does not
need: see :data:`CPU_STANDINS`), ``False`` (nothing), or an iterable of patch names to disable.

The agent is ``_agent`` (torchrun's own options and agent): where the test asks for every patch and sets none read
when the patches are applied, a child of this process's multiprocessing forkserver, which imported SAT and sat_patches
once for all such runs, its ranks forked from it; else a new interpreter whose ranks are forked from a forkserver of
the run's own; ``fresh=True`` (or ``SATP_TEST_FRESH=1``) runs torchrun itself, every rank a new interpreter.

Each rank's output, result and exit status (a signal's too) land in the run's folder (:mod:`_rank_main`). A rank
still running at the timeout (counted from when every rank wrote its pid; starting may take :data:`START_LIMIT`) is
killed with its process group (``timed_out``, ``returncode`` ``-SIGKILL``); one that never started has
``returncode`` None and torchrun's own output as its ``stderr``. torchrun ends the other ranks of its node with
SIGTERM when one fails (``returncode`` ``-SIGTERM``): a test whose survivors must outlive a failed rank puts the
ranks on separate nodes (``nodes=nranks``), as on a multi-node job.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Union

from sat_patches.core.ports import free_port

# Stand-ins for what a GPU machine has (triton, a CUDA rotary kernel); kept in "stock" runs so that
# stock SAT can be imported and run on CPU at all.
CPU_STANDINS = ("triton_rotary_import", "rotary_torch_fallback")
IMPORT_ENV = "SATP_TEST_IMPORT"   # "1": the rank imports sat_patches before its code
START_LIMIT = 300.0               # seconds the ranks may take to start, before the run's timeout begins
EXIT_GRACE = 10.0                 # seconds torchrun may take to exit once every rank has ended (its exit barrier)


def stock_disable() -> List[str]:
    import sat_patches
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

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _patch_env(patches) -> dict:
    if patches is True:
        return {IMPORT_ENV: "1", "SAT_PATCHES_DISABLE": ""}
    if patches == "stock":
        return {IMPORT_ENV: "1", "SAT_PATCHES_DISABLE": ",".join(stock_disable())}
    if patches is False or patches is None:
        return {IMPORT_ENV: "0", "SAT_PATCHES_DISABLE": ""}
    return {IMPORT_ENV: "1", "SAT_PATCHES_DISABLE": ",".join(patches)}


def base_env(env: Optional[dict] = None) -> dict:
    """This process's environment for a child Python: ``sys.path`` as its ``PYTHONPATH`` (the checkout, tests/support),
    one thread per pool, no W&B; then ``env``."""
    e = dict(os.environ)
    e.update({
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(os.path.abspath(p or os.getcwd()) for p in sys.path),
        "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
    })
    e.update({k: str(v) for k, v in (env or {}).items()})
    return e


def run_fresh(code: str, env: Optional[dict] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter (nothing imported yet), with :func:`base_env`."""
    return subprocess.run([sys.executable, "-c", code], env=base_env(env), capture_output=True, text=True,
                          timeout=timeout)


def torchrun_options(nranks: int, port: int, nodes: int, node: int, rank_args: Sequence[str]) -> List[str]:
    """torchrun's arguments for one node of a run: its options, then the rank's module and arguments."""
    if nodes < 1 or nranks % nodes:
        raise ValueError(f"{nranks} ranks do not split evenly over {nodes} node(s)")
    return ["--nproc-per-node", str(nranks // nodes), "--nnodes", str(nodes), "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            "-m", "_rank_main", *rank_args]


def _read(path: str, mode: str = "r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _children(pid: int) -> List[int]:
    found = []
    for entry in os.listdir("/proc"):
        stat = _read(f"/proc/{entry}/stat") if entry.isdigit() else None
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# the modules every rank of a shared-server run has imported (see _shared_server)
SHARED_PRELOAD = ["_agent", "sat_patches", "sat", "sat.model", "sat.training.deepspeed_training"]
# settings read when the patches are applied: a run that sets them starts a server of its own
APPLY_TIME = ("SAT_PATCHES_DISABLE", "SAT_PATCHES_FORCE")
_server = None


def _shared_server():
    """This process's multiprocessing forkserver, started once with every patch on and the test kit's environment
    (nothing a test set in this process), which imports :data:`SHARED_PRELOAD` once for all its runs."""
    global _server
    if _server is None:
        import multiprocessing
        import multiprocessing.forkserver
        multiprocessing.set_forkserver_preload(SHARED_PRELOAD)
        saved = dict(os.environ)
        try:
            os.environ.clear()
            os.environ.update({k: v for k, v in base_env(_patch_env(True)).items()
                               if not k.startswith("SAT_PATCHES_") or k == "SAT_PATCHES_DISABLE"})
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server = multiprocessing.get_context("forkserver")
    return _server


class _SharedAgent:
    """torchrun's agent for one node of a run, a child of :func:`_shared_server` (as a ``Popen`` is waited on)."""

    def __init__(self, argv, env, cwd, log):
        import _agent
        self.process = _shared_server().Process(target=_agent.in_shared_server, args=(argv, env, cwd, log))
        self.process.start()
        self.pid = self.process.pid

    def poll(self):
        return None if self.process.is_alive() else self.process.exitcode

    def wait(self):
        self.process.join()
        return self.process.exitcode


def _end(agents, files) -> None:
    """Kill what is left of a run: each torchrun still running (frozen first, so that it starts and ends no rank
    meanwhile) with its ranks, and any rank that wrote no status."""
    for agent in agents:
        if agent.poll() is None:
            os.kill(agent.pid, signal.SIGSTOP)
            for pid in _children(agent.pid):
                _killpg(pid)
            _killpg(agent.pid)
            agent.wait()
    for f in files.values():
        pid = _read(f["pid"])
        if pid and not os.path.exists(f["status"]):
            _killpg(int(pid))


def _launch(workdir: str, nranks: int, nodes: int, rank_args: Sequence[str], timeout: float, patches,
            env: Optional[dict], cwd: Optional[str], fresh: bool) -> List[RankResult]:
    files = {rank: {kind: os.path.join(workdir, f"rank{rank}.{kind}") for kind in ("out", "err", "status", "pid")}
             for rank in range(nranks)}
    with open(os.path.join(workdir, "env.json"), "w") as f:
        json.dump({k: str(v) for k, v in (env or {}).items()}, f)  # the rank sets these again over torchrun's
    agent_env = base_env({**_patch_env(patches), **(env or {})})
    fresh = fresh or os.environ.get("SATP_TEST_FRESH") == "1"  # every rank a new interpreter (to compare, to debug)
    port = free_port()
    shared = not fresh and patches is True and not set(APPLY_TIME) & set(env or {})
    agents = []
    for node in range(nodes):
        log_path = os.path.join(workdir, f"torchrun{node}.log")
        options = torchrun_options(nranks, port, nodes, node, [workdir, *rank_args])
        if shared:  # the agent forked from this process's server
            agents.append(_SharedAgent(options, agent_env, cwd, log_path))
            continue
        launcher = "torch.distributed.run" if fresh else "_agent"
        with open(log_path, "w") as log:
            agents.append(subprocess.Popen([sys.executable, "-m", launcher, *options], env=agent_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
    # the timeout counts from when every rank has started: how long interpreters take to start on a loaded machine is
    # not the test's (a rank that hangs must get the time its test gives it); starting has a limit of its own
    deadline, ended_at = time.monotonic() + START_LIMIT + timeout, None
    started = False
    try:
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            if not started and all(os.path.exists(f["pid"]) for f in files.values()):
                started, deadline = True, time.monotonic() + timeout
            if ended_at is None and all(os.path.exists(f["status"]) for f in files.values()):
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > EXIT_GRACE:
                break
            time.sleep(0.05)
    finally:  # also when the wait is interrupted (the test's own time limit): nothing of the run is left behind
        _end(agents, files)
    timed_out = {rank: not os.path.exists(f["status"]) and time.monotonic() >= deadline for rank, f in files.items()}
    results = []
    for rank, f in files.items():
        status = _read(f["status"])
        returncode = int(status) if status else (-signal.SIGKILL if timed_out[rank] else None)
        stderr = _read(f["err"])
        if stderr is None:  # the rank never started: what torchrun said
            stderr = "".join(_read(os.path.join(workdir, f"torchrun{node}.log")) or "" for node in range(nodes))
        results.append(RankResult(rank, returncode, _read(f["out"]) or "", stderr, timed_out=timed_out[rank]))
    return results


def run_ranks(fn: Union[Callable, str], nranks: int = 2, args: tuple = (), kwargs: Optional[dict] = None,
              timeout: float = 120, patches: Any = True, env: Optional[dict] = None,
              nodes: int = 1, fresh: bool = False) -> List[RankResult]:
    """Call ``fn(*args, **kwargs)`` on ``nranks`` ranks; returns one :class:`RankResult` per rank. ``nodes``: the
    ranks laid out on that many nodes (one torchrun each), all on this machine.

    ``fn`` is a module-level function or ``"module:function"``. Its return value (picklable) is
    ``result``; an exception it raises is ``exception`` (formatted traceback) and exit code 1.
    """
    target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
    with tempfile.TemporaryDirectory(prefix="satp-ranks-") as workdir:
        with open(os.path.join(workdir, "call.pkl"), "wb") as f:
            pickle.dump((target, args, kwargs or {}), f)
        results = _launch(workdir, nranks, nodes, ["--call"], timeout, patches, env, None, fresh)
        for r in results:
            outcome = _read(os.path.join(workdir, f"rank{r.rank}.result"), "rb")
            if outcome is not None:
                kind, value = pickle.loads(outcome)
                if kind == "ok":
                    r.result = value
                else:
                    r.exception = value
    return results


def run_script(argv: Sequence[str], nranks: int = 2, timeout: float = 300, patches: Any = True,
               env: Optional[dict] = None, cwd: Optional[str] = None, nodes: int = 1,
               fresh: bool = False) -> List[RankResult]:
    """Run ``python <argv>`` (a script path or ``-m module``) on ``nranks`` ranks in ``cwd`` (``nodes``: as in
    :func:`run_ranks`)."""
    with tempfile.TemporaryDirectory(prefix="satp-ranks-") as workdir:
        return _launch(workdir, nranks, nodes, ["--script", *argv], timeout, patches, env, cwd, fresh)
