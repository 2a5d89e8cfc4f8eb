"""Hang dumps: a forced hang on 2 CPU ranks ends, within the configured collective timeout, with a
stack dump from every rank naming where it is, and a non-zero exit instead of a wait."""
import re
import time

import pytest
import torch

from sat_patches.diagnostics import watchdog as hangs
from multirank import run_ranks
from patching import patches_removed

TIMEOUT = 4
ARGS = ["--mode", "finetune", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--vocab-size", "1024", "--train-iters", "1", "--batch-size", "1"]


def _slow_preprocessing():
    time.sleep(600)  # the other rank: busy elsewhere, never reaching the collective


def hang_in_parameter_sync(stall_rank=1):
    """Rank function: rank 0 enters SAT's "Syncing initialized parameters" broadcast; rank 1 never does."""
    import sat
    from sat.training.deepspeed_training import setup_model_untrainable_params_and_optimizer
    args = sat.get_args(list(ARGS))
    args.train_data = None
    model = torch.nn.Linear(4, 4)
    for p in model.parameters():
        p.model_parallel = False
    print(f"hang starts at {time.time():.3f}", flush=True)
    if torch.distributed.get_rank() == stall_rank:
        _slow_preprocessing()
    else:
        setup_model_untrainable_params_and_optimizer(args, model)
    return "no hang"


def _dump_time(stderr):
    return float(re.search(r"sat_patches: rank \d \(pid \d+\) at ([\d.]+):", stderr).group(1))


@pytest.mark.slow
def test_forced_hang_dumps_every_rank_within_the_timeout_and_exits_nonzero():
    results = run_ranks(hang_in_parameter_sync, 2, timeout=180, env={hangs.ENV: str(TIMEOUT)})
    leader, follower = results
    for r in results:
        assert not r.timed_out and r.returncode == hangs.EXIT_CODE, r.output[-3000:]
        started = float(re.search(r"hang starts at ([\d.]+)", r.stdout).group(1))
        assert TIMEOUT - 0.5 <= _dump_time(r.stderr) - started <= TIMEOUT + 5, r.stderr[-2000:]
        assert re.search(r"^(Current thread|Thread) 0x", r.stderr, re.M)  # faulthandler's dump follows
    assert f"collective 'broadcast' did not complete within {TIMEOUT} s" in leader.stderr
    assert re.search(r"Blocked SAT call: \S+/sat/training/deepspeed_training.py:\d+ in "
                     r"setup_model_untrainable_params_and_optimizer\(\)", leader.stderr)
    assert "another rank reported a collective timeout (rank 0: collective 'broadcast'" in follower.stderr
    assert "This rank is in no collective; it is at" in follower.stderr and "_slow_preprocessing" in follower.stderr


def pg_timeout_and_watchdog():
    """Rank function: SAT's get_args on one rank without the collective_timeout patch, then SAT's
    initialize_distributed again with it; the timeout of SAT's groups and the watchdog's each time."""
    import sat
    import sat.arguments
    from sat import mpu
    from patching import patches_removed

    def seen():
        groups = [torch.distributed.distributed_c10d._get_default_group(), mpu.get_data_parallel_group()]
        return {"groups": [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups],
                "watchdog": None if hangs.current_watchdog() is None else hangs.current_watchdog().timeout}
    with patches_removed("collective_timeout"):
        args = sat.get_args(list(ARGS))
        without = seen()
    sat.arguments.initialize_distributed(args)  # SAT returns at once (already set up); the patch acts
    return {"without": without, "with": seen()}


@pytest.mark.slow  # SAT's groups set up twice in a rank (~7 s)
def test_collective_timeout_patch_sets_every_sat_group_and_starts_the_watchdog():
    [r] = run_ranks(pg_timeout_and_watchdog, 1, timeout=180, env={hangs.ENV: str(TIMEOUT)})
    assert r.ok, (r.exception or r.output)[-3000:]
    assert r.result == {"without": {"groups": [1800.0, 1800.0], "watchdog": None},   # torch's 30 min, no watchdog
                        "with": {"groups": [TIMEOUT, TIMEOUT], "watchdog": TIMEOUT}}


class _Recorder(hangs.Watchdog):
    def __init__(self):
        super().__init__(timeout=1e6, poll=1)  # its faulthandler backstop never fires in a test
        self.entered = []

    def enter(self, name):
        outermost = super().enter(name)
        if outermost:  # (broadcast_object_list calls broadcast inside)
            self.entered.append(name)
        return outermost


def _call_fast(name):
    """Call a collective with an argument that makes it return or fail at once, whether or not this
    process has a process group (never a real wait)."""
    import torch.distributed as dist
    args, kwargs = ((), {"group": "not a group"}) if name == "barrier" else (("not a tensor",), {})
    try:
        getattr(dist, name)(*args, **kwargs)
    except Exception:  # noqa: BLE001
        pass


@pytest.mark.parametrize("name", hangs.COLLECTIVES)
def test_each_collective_is_timed_by_the_watchdog(name, monkeypatch):
    """Without its patch a collective is invisible to the watchdog."""
    recorder = _Recorder()
    monkeypatch.setattr(hangs, "_watchdog", recorder)
    _call_fast(name)
    assert recorder.entered == [name] and not recorder.inflight
    with patches_removed(f"hang_watch_{name}"):
        _call_fast(name)
    assert name not in recorder.entered[1:]  # (broadcast_object_list's inner broadcasts are still timed)


def test_the_backstop_is_armed_once_for_many_collectives_and_cancelled_when_idle(monkeypatch):
    """faulthandler starts (and joins) a thread of its own at every arming: a timed collective must not
    arm it each time (that cost several ms per training step)."""
    import faulthandler
    armed, cancelled = [], []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda delay, **kw: armed.append(delay))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: cancelled.append(1))
    watchdog = hangs.Watchdog(timeout=600.0, poll=1.0)
    for _ in range(100):
        watchdog.leave(watchdog.enter("all_reduce"))
    assert len(armed) == 1 and 600 < armed[0] <= 600 + hangs.GRACE and not cancelled
    watchdog._move_backstop()       # the watchdog's look: nothing runs now
    assert cancelled == [1] and watchdog.backstop_at is None
    outermost = watchdog.enter("barrier")
    watchdog._move_backstop()       # a collective runs: its deadline stays
    assert len(armed) == 2 and cancelled == [1]
    watchdog.leave(outermost)


def test_timeout_setting_is_validated(monkeypatch):
    monkeypatch.setenv(hangs.ENV, "0")
    with pytest.raises(ValueError, match="positive number of seconds"):
        hangs.collective_timeout()
    monkeypatch.setenv(hangs.ENV, "90")
    assert hangs.collective_timeout() == 90.0


def test_one_classifier_reads_timeouts_lost_peers_and_missing_backends():
    """hangs, faults and distributed all read errors through coordination.error_kinds."""
    import torch.distributed as dist
    from sat_patches.core.coordination import NO_BACKEND, PEER_LOST, TIMED_OUT, error_kinds
    assert error_kinds(RuntimeError("[gloo/transport/tcp/pair.cc:446] Timed out waiting 5000ms for recv")) == {TIMED_OUT}
    assert error_kinds(RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(...)")) >= {TIMED_OUT}
    assert error_kinds(RuntimeError("Connection reset by peer")) == {PEER_LOST}
    assert PEER_LOST in error_kinds(dist.DistNetworkError("failed to recv, got 0 bytes"))
    assert error_kinds(RuntimeError("No backend type associated with device type cpu")) == {NO_BACKEND}
    assert error_kinds(ValueError("image folder is empty")) == frozenset()


def test_a_collective_failing_while_the_watchdog_reports_a_hang_waits_for_its_exit(monkeypatch):
    """The leader's report ends in ``os._exit(EXIT_CODE)`` after a pause that lets the others read it; a
    follower that exits in that pause makes the leader's blocked collective fail ("Connection closed by
    peer"). That failure must not end the rank first (status 1, a gloo error after the dump): the
    collective waits for the report's exit."""
    import threading
    recorder = _Recorder()
    monkeypatch.setattr(hangs, "_watchdog", recorder)
    recorder.fired.acquire()  # the watchdog thread is reporting
    done = threading.Event()
    caller = threading.Thread(target=lambda: (_call_fast("broadcast"), done.set()), daemon=True)
    caller.start()
    assert not done.wait(1.0)  # the failed collective does not return while the report is under way
    recorder.fired.release()   # (a real report never returns: os._exit)
    assert done.wait(5.0)
