import atexit
import gc
import os
import shutil
import sys
import tempfile

import pytest

# tests/support: helpers the tests share (and the ranks they start, which inherit this sys.path)
# benchmarks/calibration: the plan's calibration tools, which the calibration tests run
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "support"), os.path.join(os.path.dirname(HERE), "benchmarks", "calibration")]

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Hugging Face's import-time settings, one value for the whole session (the controller's, which pytest-xdist's workers
# inherit): no hub is reached, and remote code that a test loads is cached in the session's own folder, not the
# user's.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="satp-hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], True)


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pytest.ini) on this project's 2-core machines. The whole suite: three; many
    multi-rank tests wait (on timeouts, heartbeats, rank start-up) and a third worker fills that time
    (measured: 6 min 8 s against 7 min 18 s with two). The fast tier (``-m "not slow"``): two; its tests mostly
    compute, and a third worker's start-up (SAT imported) costs more than it gives back
    (measured: 2 min 1 s against 2 min 12 s with three)."""
    return 2 if "not slow" in (config.getoption("markexpr") or "") else 3


def pytest_configure(config):
    # The test process runs with every patch applied, as a user's process that imported sat_patches and
    # SAT does (``import sat_patches`` alone defers them until SAT is imported). An xdist controller
    # runs no test: it skips the SAT import.
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import sat_patches
    sat_patches.apply()


def pytest_collection_finish(session):
    # What the imports and the collection made (torch, SAT, every test module: about half a million objects) stays
    # for the session: out of the cyclic collector's reach, whose full collections otherwise scan it all (0.2-0.3 s
    # each, a dozen per worker in the fast tier). What a test makes is collected as before.
    gc.freeze()


# What a test weighs when the modules are ordered (a module's weight: the sum over its tests)
WEIGHT_SLOW, WEIGHT_MULTIRANK, WEIGHT_OTHER = 5.0, 3.0, 0.3


def heaviest_modules_first(items) -> None:
    """Order the modules by their tests' weight, heaviest first, each module's tests kept together and in their
    order. pytest-xdist (``--dist loadscope``) hands the modules out in this order: the modules with many slow or
    multi-rank tests start early, and the modules of quick tests fill the end of the run, where one long module used
    to run on alone after the other workers had finished (measured on a 2-core machine: the workers' last tests
    ended 28 s apart in the collection's order, 12 s apart in this one). The weights are the markers' (a slow test:
    an end-to-end run or a fresh interpreter; a multirank test: ranks), a rough guide."""
    def module(item):
        return item.nodeid.split("::", 1)[0]
    weight: dict = {}
    for item in items:
        weight[module(item)] = weight.get(module(item), 0.0) + (
            WEIGHT_SLOW if "slow" in item.keywords else WEIGHT_MULTIRANK if "multirank" in item.keywords else WEIGHT_OTHER)
    items.sort(key=lambda item: -weight[module(item)])  # stable: ties keep the collection's order


def pytest_collection_modifyitems(config, items):
    heaviest_modules_first(items)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU-only: this machine has no CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
