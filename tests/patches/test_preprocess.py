"""Data preprocessing on rank 0 first: on 2 CPU ranks SAT's make_loaders (through the
name training_main calls) runs the tiny LoRA script's create_dataset on rank 0 before rank 1; rank 0's
error reaches rank 1 at once; a rank 0 past SAT_PATCHES_PREPROCESS_TIMEOUT is named by rank 1. Stock
counterparts (the patch disabled): the ranks preprocess at once and rank 1 is told nothing.

Three 2-rank runs (patched: order then failure; stock: the same; patched: timeout) keep the file short."""
import os
import time
import traceback

import pytest

from sat_patches.runtime import preprocess
from multirank import run_ranks

PATCH = "preprocess_rank0_first"
ERROR = "image folder /data/captcha has 3 unreadable files"
ORDER = {"rank0_seconds": 2.0}
FAIL = {"rank0_error": ERROR}


def load_data(scenarios, heartbeat=None):
    """Rank function: SAT's get_args (gloo ranks), then per scenario SAT's make_loaders as training_main
    calls it. Rank 0's create_dataset takes ``rank0_seconds`` (cut short once the file ``release``
    exists) and may raise ``rank0_error``. Per scenario: this rank's create_dataset spans, the error
    make_loaders raised here (message and traceback) and how long the call took."""
    import sat
    import torch.distributed as dist
    from sat_patches.diagnostics import heartbeat as faults
    import tiny_lora

    args = sat.get_args(list(tiny_lora.DEFAULT_ARGS))
    hb = faults.start_heartbeat(heartbeat) if heartbeat else None
    outcomes = [_load_once(args, dist.get_rank(), **scenario) for scenario in scenarios]
    if hb is not None:  # both alive until both stopped beating: a normal end is no death
        dist.barrier()
        hb.done()
        dist.barrier()
    return outcomes


def _load_once(args, rank, rank0_seconds=0.0, rank0_error=None, release=None):
    from sat.training import deepspeed_training
    import tiny_lora
    spans = []

    def create_dataset(path, args):
        start = time.time()
        if rank == 0:
            while time.time() - start < rank0_seconds and not (release and os.path.exists(release)):
                time.sleep(0.05)
            if rank0_error:
                raise ValueError(rank0_error)
        spans.append((start, time.time()))
        return tiny_lora.create_dataset(path, args)

    called, error, trace = time.time(), None, None
    try:
        deepspeed_training.make_loaders(args, create_dataset)
    except Exception as exc:  # noqa: BLE001
        error, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
    if release and rank != 0:
        open(release, "w").close()
    return {"spans": spans, "error": error, "traceback": trace, "waited": time.time() - called}


def _ranks(patches, scenarios, env=None, **kwargs):
    results = run_ranks(load_data, 2, args=(scenarios,), kwargs=kwargs, timeout=90, patches=patches, env=env)
    for r in results:
        assert r.ok, (r.exception or r.output)[-3000:]
    return [r.result for r in results]


@pytest.fixture(scope="module")
def patched():
    """Both scenarios with the patch; each rank's heartbeat (1 s timeout) runs throughout."""
    return _ranks(True, [ORDER, FAIL], env={preprocess.ENV: "60"}, heartbeat=1.0)


@pytest.fixture(scope="module")
def stock():
    return _ranks([PATCH], [ORDER, FAIL])


@pytest.mark.multirank
def test_rank1_preprocesses_only_after_rank0_and_heartbeats_go_on(patched):
    (r0, _), (r1, _) = patched
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    [(_, end0)], [(start1, _)] = r0["spans"], r1["spans"]
    assert start1 >= end0, (r0, r1)
    # rank 1 waited ~2 s, twice the heartbeat timeout, and nobody was declared dead (that exits the rank)
    assert r1["waited"] >= 1.5, r1


@pytest.mark.slow  # stock SAT's run (its fixture): the fast tier keeps the patched ranks
@pytest.mark.multirank
def test_stock_ranks_preprocess_at_the_same_time(stock):
    (r0, _), (r1, _) = stock
    [(_, end0)], [(start1, _)] = r0["spans"], r1["spans"]
    assert start1 < end0 - 1.0, (r0, r1)  # overlap: rank 1 did not wait for rank 0


@pytest.mark.multirank
def test_rank0_error_reaches_rank1_at_once(patched):
    (_, r0), (_, r1) = patched
    assert r0["error"] == f"ValueError: {ERROR}", r0  # rank 0 re-raises its own exception, traceback and all
    assert r0["traceback"].startswith("Traceback") and "in create_dataset" in r0["traceback"], r0["traceback"]
    assert r1["error"] == (f"RuntimeError: rank 1: rank 0 failed while {preprocess.STAGE}: ValueError: {ERROR} "
                           f"(rank 0's log has its traceback); this rank stops too"), r1
    assert r1["waited"] < 15 and r1["spans"] == [], r1  # not after the 60 s timeout; no run of its own


@pytest.mark.slow
@pytest.mark.multirank
def test_stock_rank1_is_not_told_of_rank0_error(stock):
    (_, r0), (_, r1) = stock
    assert r0["error"] == f"ValueError: {ERROR}", r0
    assert r1["error"] is None and len(r1["spans"]) == 1, r1  # carries on, told nothing


@pytest.mark.slow  # waits out its timeout (~5 s)
@pytest.mark.multirank
def test_rank0_past_the_timeout_is_named_by_rank1(tmp_path):
    release = str(tmp_path / "release")
    [r0], [r1] = _ranks(True, [{"rank0_seconds": 20.0, "release": release}], env={preprocess.ENV: "3"})
    assert r1["error"].startswith(f"RuntimeError: rank 1: gave up waiting for rank 0 while it was "
                                  f"{preprocess.STAGE}: it did not finish within 3 s."), r1
    assert f"raise {preprocess.ENV} (now 3 s)" in r1["error"]
    assert 2.5 <= r1["waited"] <= 10, r1
    # rank 0, released once rank 1 gave up, finds nobody waiting and says so
    assert r0["error"].startswith(f"RuntimeError: rank 0 finished {preprocess.STAGE}, but not every other rank"), r0


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_bad_timeout_value_is_refused_before_any_collective(monkeypatch, value):
    import torch.distributed as dist
    monkeypatch.setenv(preprocess.ENV, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match=rf"{preprocess.ENV}='{value}': set it to a positive number of seconds"):
        preprocess.rank0_first(lambda: pytest.fail("ran before the timeout was checked"))


def test_timeout_default_and_value(monkeypatch):
    monkeypatch.delenv(preprocess.ENV, raising=False)
    assert preprocess.preprocess_timeout() == 7200
    monkeypatch.setenv(preprocess.ENV, "90.5")
    assert preprocess.preprocess_timeout() == 90.5


def test_patch_applied_on_the_name_training_main_calls():
    import torch.distributed as dist
    import sat.data_utils
    import sat.training.deepspeed_training as deepspeed_training
    import sat_patches
    from sat_patches.diagnostics import watchdog as hangs
    from sat_patches.core.registry import REGISTRY
    from patching import patches_removed

    [row] = [r for r in sat_patches.status() if r["name"] == PATCH]
    assert row["status"] == "applied" and row["target"] == "sat.data_utils.configure_data:make_loaders"
    patch = REGISTRY.get(PATCH)
    assert deepspeed_training.make_loaders is sat.data_utils.make_loaders is patch.replacement
    with patches_removed(PATCH):
        assert deepspeed_training.make_loaders is patch.original
    assert deepspeed_training.make_loaders is REGISTRY.get(PATCH).replacement
    # the wait must not be cut by hangs' (shorter) collective timeout
    assert "monitored_barrier" not in hangs.COLLECTIVES and not hasattr(dist.monitored_barrier, "__sat_patches__")
