"""A CPU run's ranks started from one interpreter:
``python -m sat_patches.runner.cpu_ranks --nproc-per-node N --master-port PORT -m MODULE [ARGS...]``.

What ``torchrun --nproc-per-node N --master-port PORT -m MODULE ARGS`` does for the scripts' CPU runs on this
machine, without each rank starting an interpreter from nothing: what every rank imports (torch, DeepSpeed, SAT,
transformers for the tokenizer, and torch's compiler, which ``torch.optim`` imports at a rank's first step) is
imported once, here, before any computation and while this process has no thread of its own; then each rank is
forked with the variables torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...,
``MASTER_ADDR``/``MASTER_PORT``; ``OMP_NUM_THREADS=1`` unless set) and runs ``MODULE`` as ``__main__``, as
``python -u -m MODULE ARGS`` would, its output unbuffered, and exits as that would (without the interpreter's
teardown, which writes nothing). Each rank then computes, builds its process group and
exits on its own. The imports cost 5-7 s of CPU per rank on a 2-core machine, about half of a tiny run's time.

As torchrun: a rank that fails stops the others (``SIGTERM``, ``SIGKILL`` after :data:`GRACE` seconds) and the
launcher's status is that rank's (said on stderr with the rank); ``SIGINT``/``SIGTERM`` sent to the launcher reach
every rank. For CPU ranks on one node only: a process forked after CUDA was initialised cannot use CUDA, and the
GPU runs of the scripts use the DeepSpeed launcher.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import io
import os
import runpy
import signal
import sys
import time
import traceback
from typing import Dict, List

from ..cli import exit_forked, exit_now
from ..core.rank_env import torchrun_variables

# what a rank of the scripts imports before its first step, in the order a rank imports it
PRELOAD = ("torch", "torch.distributed", "deepspeed", "sat", "transformers", "torch._dynamo")
GRACE = 10.0  # seconds the other ranks get to exit after one failed, before SIGKILL
FORWARDED = {signal.SIGINT, signal.SIGTERM}  # what the launcher passes on to every rank


def options(argv: List[str]) -> argparse.Namespace:
    """The launcher's options, then ``-m MODULE``; everything after the module is the module's (``module``,
    ``args``)."""
    parser = argparse.ArgumentParser(prog="python -m sat_patches.runner.cpu_ranks",
                                     usage="%(prog)s --nproc-per-node N --master-port PORT -m MODULE [ARGS...]",
                                     description="Start CPU ranks on this machine, each forked after the imports "
                                                 "every rank makes, with torchrun's worker environment.")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start")
    parser.add_argument("--master-port", type=int, required=True, help="the rendezvous port on loopback")
    split = argv.index("-m") if "-m" in argv else len(argv)
    opts = parser.parse_args(argv[:split])
    if split + 1 >= len(argv):
        parser.error("-m MODULE: the module each rank runs as __main__")
    if opts.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {opts.nproc_per_node}: at least 1")
    opts.module, opts.args = argv[split + 1], argv[split + 2:]
    return opts


def preload() -> None:
    """Import what every rank imports (a module that is not installed is left to the rank to report)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # the imports' objects move out of the cyclic collector's reach: a rank's collections skip them, and the
    # pages that hold them stay shared between the ranks
    gc.freeze()


def _unbuffered() -> None:
    """stdout and stderr as ``python -u`` has them: every write reaches the file at once."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True))


def _threads_as_set() -> None:
    """torch's thread pool as ``OMP_NUM_THREADS`` says, though torch was loaded before the rank's environment
    was set (where the launcher was forked from a process that had imported it)."""
    torch, threads = sys.modules.get("torch"), os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _be_rank(module: str, args: List[str], variables: Dict[str, str]) -> None:
    """(in the forked child) Run ``module`` as ``__main__`` and exit as ``python -m`` would; never returns."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # blocked by the launcher around the fork
    os.environ.update(variables)
    _threads_as_set()
    _unbuffered()
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 (printed as an uncaught exception is; status 1, as python's)
        traceback.print_exc()
        code = 1
    exit_forked(code)


def describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


def forward_signals(ranks: Dict[int, int]) -> List[int]:
    """SIGINT and SIGTERM sent to the launcher go to every rank in ``ranks``; returns the list of those received."""
    received: List[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    return received


def supervise(ranks: Dict[int, int], received: List[int]) -> int:
    """Wait for the ranks (pid -> rank); the first failure stops the others. Returns the launcher's status."""
    failed, deadline = None, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG if deadline else 0)
        if pid == 0:  # the others are stopping
            if time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = code
            stopping = f": stopping the other {len(ranks)} rank(s)" if ranks else ""
            print(f"sat_patches.runner.cpu_ranks: rank {rank} exited with {describe(code)}{stopping}", file=sys.stderr,
                  flush=True)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            if ranks:
                deadline = time.monotonic() + GRACE
    if failed is None:
        return 128 + received[0] if received else 0
    return 128 - failed if failed < 0 else failed


def main(argv=None) -> int:
    opts = options(sys.argv[1:] if argv is None else argv)
    if opts.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, read when torch loads OpenMP
    preload()
    ranks: Dict[int, int] = {}
    received = forward_signals(ranks)
    for rank in range(opts.nproc_per_node):
        variables = torchrun_variables(rank, opts.nproc_per_node, opts.master_port)
        sys.stdout.flush()
        sys.stderr.flush()
        # a signal in the fork's window waits: the child must not run the launcher's handler, and the launcher
        # forwards it once the child is one of its ranks
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        pid = os.fork()
        if pid == 0:
            _be_rank(opts.module, opts.args, variables)  # never returns
        ranks[pid] = rank
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    return supervise(ranks, received)


if __name__ == "__main__":
    exit_now(main())  # without the teardown of what was preloaded
