"""torchrun whose ranks are forked from one process that imported their modules once, for :mod:`multirank`:
``python -m _agent TORCHRUN-OPTIONS -m _rank_main RUN-FOLDER ...``.

torchrun's own options and configuration (``torch.distributed.run``), its agent and rendezvous; only the workers
start another way: ``elastic_launch`` with the ``forkserver`` start method, whose server imports :func:`preload`
once (Python's ``multiprocessing.set_forkserver_preload``). Each rank then skips the seconds a new interpreter
spends importing torch, SAT and sat_patches. Such a rank is a multiprocessing child: it ends by ``os._exit`` after
its atexit handlers, without the interpreter's teardown (a test that needs the teardown asks for fresh interpreters).
"""
import multiprocessing
import os
import sys

from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args

import _rank_main


def preload() -> list:
    """What every rank of this run imports first: sat_patches and SAT where the test asks for sat_patches (their
    settings are this process's environment, the test's), else nothing (the rank imports what it needs)."""
    if os.environ.get("SATP_TEST_IMPORT", "1") == "1":
        return ["sat_patches", "sat", "sat.model", "sat.training.deepspeed_training"]
    return []


def main(argv, start_method: str = "forkserver") -> None:
    args = parse_args(argv)
    config, _, _ = config_from_args(args)
    config.start_method = start_method
    multiprocessing.set_forkserver_preload(preload())
    elastic_launch(config, _rank_main.forked)(*args.training_script_args)


def in_shared_server(argv, env: dict, cwd, log: str) -> None:
    """The agent as a child of the test process's own forkserver (:mod:`multirank`), which imported sat_patches and
    SAT once for every run of that process: this run's environment, folder and output, then its ranks forked from
    here (a process group of its own, as ``start_new_session`` gives the subprocess agent)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1), os.dup2(out, 2), os.close(out)
    main(argv, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1:])
