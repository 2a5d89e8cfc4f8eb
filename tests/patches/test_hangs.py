"""Hang dumps: a forced hang on 2 CPU ranks ends, within the configured collective timeout, with a
stack dump from every rank naming where it is, and a non-zero exit instead of a wait."""
import contextlib
import os
import re
import signal
import sys
import textwrap
import threading
import time

import pytest
import torch

from sat_patches.diagnostics import watchdog as hangs
from sat_patches.patches import hangs as hangs_patches
from multirank import run_ranks
from patching import patches_removed

TIMEOUT = 4
ARGS = ["--mode", "finetune", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--vocab-size", "1024", "--train-iters", "1", "--batch-size", "1"]


def _slow_preprocessing():
    time.sleep(600)  # the other rank: busy elsewhere, never reaching the collective


def hang_in_parameter_sync(stall_rank=1, terminate_after=None):
    """Rank function: rank 0 enters SAT's "Syncing initialized parameters" broadcast; rank 1 never does
    (``terminate_after``: rank 1 sends rank 0 SIGTERM after that many seconds, as torchrun does)."""
    import os
    import sat
    from sat.training.deepspeed_training import setup_model_untrainable_params_and_optimizer
    args = sat.get_args(list(ARGS))
    args.train_data = None
    model = torch.nn.Linear(4, 4)
    for p in model.parameters():
        p.model_parallel = False
    store = torch.distributed.distributed_c10d._get_default_store()
    print(f"hang starts at {time.time():.3f}", flush=True)
    if torch.distributed.get_rank() == stall_rank:
        if terminate_after is not None:
            peer = int(store.get("pid"))
            time.sleep(terminate_after)
            os.kill(peer, signal.SIGTERM)
        _slow_preprocessing()
    else:
        store.set("pid", str(os.getpid()))
        setup_model_untrainable_params_and_optimizer(args, model)
    return "no hang"


def _dump_time(stderr):
    return float(re.search(r"sat_patches: rank \d \(pid \d+\) at ([\d.]+):", stderr).group(1))


@pytest.mark.slow
def test_forced_hang_dumps_every_rank_within_the_timeout_and_exits_nonzero():
    # one rank a node: each rank must end itself (within one node torchrun would end the other once one failed)
    results = run_ranks(hang_in_parameter_sync, 2, nodes=2, timeout=180, env={hangs.ENV: str(TIMEOUT)})
    leader, follower = results
    for r in results:
        assert not r.timed_out and r.returncode == hangs.EXIT_CODE, r.output[-3000:]
        started = float(re.search(r"hang starts at ([\d.]+)", r.stdout).group(1))
        assert TIMEOUT - 0.5 <= _dump_time(r.stderr) - started <= TIMEOUT + 5, r.stderr[-2000:]
        assert re.search(r"^(Current thread|Thread) 0x", r.stderr, re.M)  # faulthandler's dump follows
    assert f"collective 'broadcast' did not complete within {TIMEOUT} s" in leader.stderr
    assert re.search(r"Blocked SAT call: \S+/sat/training/deepspeed_training.py:\d+ in "
                     r"setup_model_untrainable_params_and_optimizer\(\) \(in SAT's "
                     r"setup_model_untrainable_params_and_optimizer\)", leader.stderr)
    assert "another rank ended the run (rank 0: collective 'broadcast'" in follower.stderr
    assert "This rank is in no collective; it is at" in follower.stderr and "_slow_preprocessing" in follower.stderr


def hang_in_recv():
    """Rank function: rank 0 waits in ``recv`` (gloo gives it no timeout) outside any SAT call; rank 1 never sends."""
    import sat
    sat.get_args(list(ARGS))
    print(f"hang starts at {time.time():.3f}", flush=True)
    if torch.distributed.get_rank() == 1:
        _slow_preprocessing()
    torch.distributed.recv(torch.zeros(1), src=1)
    return "no hang"


@pytest.mark.slow
def test_a_collective_without_a_timeout_of_its_own_is_ended_by_the_watchdog():
    """The watchdog reads each thread's stack: a collective that torch never times out (gloo's recv) is seen."""
    leader, follower = run_ranks(hang_in_recv, 2, timeout=180, env={hangs.ENV: str(TIMEOUT)})
    for r in (leader, follower):
        assert not r.timed_out and r.returncode == hangs.EXIT_CODE, r.output[-3000:]
        started = float(re.search(r"hang starts at ([\d.]+)", r.stdout).group(1))
        assert TIMEOUT - 0.5 <= _dump_time(r.stderr) - started <= TIMEOUT + 5, r.stderr[-2000:]
    assert f"collective 'recv' did not complete within {TIMEOUT} s. Blocked in: " in leader.stderr, \
        leader.stderr[-2000:]
    assert re.search(r"test_hangs.py:\d+ in hang_in_recv\(\)", leader.stderr)
    assert "another rank ended the run (rank 0: collective 'recv'" in follower.stderr


@pytest.mark.slow
def test_a_terminated_rank_dumps_names_its_sat_call_and_the_others_end():
    """torchrun SIGTERMs the other ranks when one fails: a rank blocked in a collective (gloo's timeout far off)
    still dumps its stacks at once, names the SAT call it waited in and exits non-zero; the other rank ends too."""
    results = run_ranks(hang_in_parameter_sync, 2, kwargs={"terminate_after": 2.0}, timeout=180,
                        env={hangs.ENV: "120"})
    terminated, other = results
    for r in results:
        assert not r.timed_out, r.output[-3000:]
        started = float(re.search(r"hang starts at ([\d.]+)", r.stdout).group(1))
        assert _dump_time(r.stderr) - started < 15, r.stderr[-2000:]
        assert re.search(r"^(Current thread|Thread) 0x", r.stderr, re.M), r.stderr[-2000:]
    assert terminated.returncode == hangs.TERMINATED_EXIT_CODE, terminated.output[-3000:]
    assert "received SIGTERM" in terminated.stderr
    assert re.search(r"Blocked SAT call: \S+/sat/training/deepspeed_training.py:\d+ in "
                     r"setup_model_untrainable_params_and_optimizer\(\) \(in SAT's "
                     r"setup_model_untrainable_params_and_optimizer\)", terminated.stderr), terminated.stderr[-2000:]
    # faulthandler's dump, taken at the signal, shows the collective SAT waited in
    assert re.search(r"line \d+ in broadcast\n", terminated.stderr), terminated.stderr[-3000:]
    assert other.returncode == hangs.EXIT_CODE and "(rank 0: received SIGTERM" in other.stderr, other.stderr[-2000:]


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
                "watchdog": None if hangs._watchdog is None else hangs._watchdog.timeout}
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


def _fake_torch_distributed(source: str) -> dict:
    """Functions defined as if in torch/distributed/distributed_c10d.py (where the watchdog looks for collectives)."""
    namespace = {"time": time}
    filename = os.path.join(os.sep, "site-packages", "torch", "distributed", "distributed_c10d.py")
    exec(compile(textwrap.dedent(source), filename, "exec"), namespace)
    return namespace


FAKE = _fake_torch_distributed("""
    def all_reduce(lock):
        lock.acquire()   # blocks in C, as torch's collectives do in work.wait()

    def monitored_barrier(lock):
        lock.acquire()

    def broadcast(seconds):
        time.sleep(seconds)

    def barrier():
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation")
""")


class _Fired(Exception):
    pass


@pytest.fixture
def fired(monkeypatch):
    """Reports made instead of ending the process: (reason, thread id, where)."""
    reports = []

    def fire(reason, thread_id, leader, where=None, **kwargs):
        reports.append((reason, thread_id, where))
        raise _Fired(reason)
    monkeypatch.setattr(hangs, "fire", fire)
    return reports


def _held_lock():
    lock = threading.Lock()
    lock.acquire()
    return lock


def _in_thread(fn, *args):
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("name", hangs.COLLECTIVES)
def test_the_watchdog_finds_each_torch_collective_where_it_looks(name):
    """The watchdog recognises a collective by its function's name and file: torch's own functions must
    match (they are not wrapped)."""
    import inspect
    import torch.distributed as dist
    code = inspect.unwrap(getattr(dist, name)).__code__
    assert code.co_name == name and hangs._TORCH_DISTRIBUTED in code.co_filename


def test_a_thread_in_the_same_collective_past_the_timeout_is_reported(fired):
    watchdog = hangs.Watchdog(timeout=0.3, poll=0.1)
    stuck, waiting = _held_lock(), _held_lock()
    blocked = _in_thread(FAKE["all_reduce"], stuck)
    _in_thread(FAKE["monitored_barrier"], waiting)   # has its own timeout: never timed here
    time.sleep(0.1)
    watchdog.look()
    assert list(watchdog.blocked) == [blocked.ident] and not fired
    time.sleep(0.4)
    with pytest.raises(_Fired):
        watchdog.look()
    assert fired == [("collective 'all_reduce' did not complete within 0.3 s", blocked.ident, None)]
    stuck.release(), waiting.release()


def test_many_short_collectives_are_never_reported(fired):
    """Each call is a new frame: a loop of quick collectives is not one long one."""
    watchdog = hangs.Watchdog(timeout=0.3, poll=0.1)
    stop = threading.Event()
    _in_thread(lambda: [FAKE["broadcast"](0.02) for _ in iter(stop.is_set, True)])
    for _ in range(12):
        watchdog.look()
        time.sleep(0.1)
    stop.set()
    assert not fired


@pytest.mark.parametrize("name", sorted(hangs_patches.WATCHED))
def test_each_sat_call_that_runs_collectives_is_watched(name):
    """Each watched SAT function (not a torch one) carries its patch, around SAT's own code."""
    import importlib
    from sat_patches.core.registry import REGISTRY, _innermost
    patch = REGISTRY.get(name)
    assert patch.status == "applied" and patch.target.startswith("sat.")
    module, _, attr = patch.target.partition(":")
    assert _innermost(patch.current()).__module__ == module and _innermost(patch.current()).__name__ == attr
    with patches_removed(name):
        assert not patch.is_applied()


def test_a_timed_out_collective_in_a_sat_call_names_the_call_and_ends_the_run(fired):
    def sat_function():
        FAKE["barrier"]()
    with pytest.raises(_Fired):
        hangs_patches._watched("save_checkpoint")(sat_function)()
    [(reason, thread_id, where)] = fired
    assert reason.startswith("collective 'barrier' did not complete within ") and "Timed out waiting 4000ms" in reason
    assert thread_id == threading.get_ident() and where.endswith("(in SAT's save_checkpoint)")
    assert hangs.sat_call_of(thread_id) is None   # the record ends with the call


def test_other_errors_in_a_sat_call_are_raised_unchanged(fired):
    """An error that only mentions a timeout (the preprocessing wait's own) is not a collective's."""
    def preprocessing():
        raise RuntimeError("rank 1: gave up waiting for rank 0: raise SAT_PATCHES_PREPROCESS_TIMEOUT")

    def no_backend():
        raise RuntimeError("No backend type associated with device type cpu")
    for failing in (preprocessing, no_backend):
        with pytest.raises(RuntimeError) as raised:
            hangs_patches._watched("training_main")(failing)()
        assert raised.value.__traceback__ is not None and not fired


def test_a_rank_names_the_sat_call_it_is_in(fired):
    started, release = threading.Event(), _held_lock()

    def sat_function():
        started.set()
        FAKE["all_reduce"](release)
    thread = _in_thread(hangs_patches._watched("train_step")(sat_function))
    started.wait(5)
    time.sleep(0.05)
    where = hangs.blocked_call(thread.ident)
    release.release()
    assert where.startswith("Blocked in: ") and where.endswith("in sat_function() (in SAT's train_step)"), where


def test_the_backstop_is_armed_once_per_collective_and_cancelled_when_idle(monkeypatch):
    """faulthandler starts (and joins) a thread of its own at every arming: armed only when the main
    thread's collective changes, not at every look."""
    import faulthandler
    armed, cancelled = [], []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda delay, **kw: armed.append(delay))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: cancelled.append(1))
    watchdog = hangs.Watchdog(timeout=600.0, poll=1.0)
    main = threading.main_thread().ident
    watchdog.blocked = {main: (sys._getframe(), time.monotonic())}
    for _ in range(100):
        watchdog.move_backstop()
    assert len(armed) == 1 and 600 < armed[0] <= 600 + hangs.GRACE and not cancelled
    watchdog.blocked = {}
    watchdog.move_backstop()
    assert cancelled == [1] and watchdog.backstop_at is None
    watchdog.blocked = {main: (sys._getframe(), time.monotonic())}
    watchdog.move_backstop()
    assert len(armed) == 2 and cancelled == [1]


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


def test_nccl_flight_recorder_is_turned_on_where_nccl_runs_keeping_the_users_values():
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    assert hangs.enable_nccl_flight_recorder(environ, nccl=True) == ["TORCH_NCCL_DUMP_ON_TIMEOUT"]
    assert environ == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    environ = {}
    assert hangs.enable_nccl_flight_recorder(environ, nccl=False) == [] and environ == {}


def test_a_collective_failing_while_the_watchdog_reports_a_hang_waits_for_its_exit(monkeypatch):
    """The leader's report ends in ``os._exit(EXIT_CODE)`` after a pause that lets the others read it; a
    follower that exits in that pause makes the leader's blocked collective fail ("Connection closed by
    peer"). That failure must not end the rank first (status 1, a gloo error after the dump): the SAT
    call waits for the report's exit."""
    watchdog = hangs.Watchdog(timeout=1e6, poll=1)
    monkeypatch.setattr(hangs, "_watchdog", watchdog)
    watchdog.fired.acquire()  # the watchdog thread is reporting

    def closed_by_peer():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321")
    done = threading.Event()

    def caller():
        with contextlib.suppress(RuntimeError):
            hangs_patches._watched("train_step")(closed_by_peer)()
        done.set()
    _in_thread(caller)
    assert not done.wait(1.0)  # the failed collective does not return while the report is under way
    watchdog.fired.release()   # (a real report never returns: os._exit)
    assert done.wait(5.0)


def test_the_watchdog_and_heartbeat_threads_are_stopped_and_joined_at_exit(monkeypatch):
    """A daemon thread that the interpreter's teardown catches inside a store call aborts the finished rank
    ('terminate called without an active exception': seen on the two-node runs): each is stopped by an exit
    handler, registered after the process group's destruction, so it runs first."""
    from sat_patches.diagnostics import heartbeat

    class Store:
        def add(self, key, n):
            return 1

        def check(self, keys):
            return False

    registered = []
    monkeypatch.setattr(hangs, "_watchdog", None)
    monkeypatch.setattr(heartbeat, "_heartbeat", None)
    monkeypatch.setattr(hangs.Watchdog, "catch_sigterm", lambda self: None)
    for module in (hangs, heartbeat):
        monkeypatch.setattr(module.atexit, "register", registered.append)
    watchdog = hangs.start_watchdog(timeout=600.0)
    beat = heartbeat.Heartbeat(Store(), 0, 2, timeout=600.0)
    beat.thread.start()
    assert registered == [watchdog.close]
    started = time.monotonic()
    watchdog.close(), beat.close()
    assert not watchdog.thread.is_alive() and not beat.thread.is_alive()
    assert time.monotonic() - started < 1.0  # woken, not waited out
