"""The test kit's run_ranks/run_script: ranks started by torchrun, each with its own output, result and exit status
(a signal included), timed out and killed with their process groups, patched or stock as asked."""
import os
import signal
import sys
import time

import pytest

import multirank
from multirank import run_fresh, run_ranks, run_script

pytestmark = pytest.mark.multirank


def report(marker):
    """Rank function: what the rank sees of its launcher, environment and output streams."""
    print(f"out {marker} rank {os.environ['RANK']}")
    print(f"err {marker} rank {os.environ['RANK']}", file=sys.stderr)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "OMP_NUM_THREADS",
             "SATP_PROBE")
    return {"env": {k: os.environ.get(k) for k in names}, "torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
            "pid": os.getpid(), "stdin": os.readlink("/proc/self/fd/0"), "cwd": os.getcwd()}


def patch_state():
    """Rank function: is SAT's broadcast_data patched (ours under the hang watch's wrapper), and is the function on
    SAT's module SAT's own code."""
    import sat.mpu.data
    import sat_patches
    from sat_patches.core.registry import REGISTRY
    return {"is_patched": sat_patches.is_patched("broadcast_data_device"),
            "sat_has_replacement": REGISTRY.get("broadcast_data_device").is_applied(),
            "code_file": os.path.basename(sat.mpu.data.broadcast_data.__code__.co_filename)}


def kill_rank_1():
    """Rank function: rank 1 SIGKILLs itself; rank 0 waits (torchrun ends it), or, on a node of its own, fails after."""
    if os.environ["RANK"] == "1":
        print("about to SIGKILL myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3)
    print("outlived rank 1", flush=True)
    raise SystemExit(5)


def hang(dump_after):
    """Never returns; faulthandler dumps the stacks to stderr first, as the hang patches do."""
    import faulthandler
    faulthandler.dump_traceback_later(dump_after, exit=False, file=sys.stderr)
    print("hanging", flush=True)
    while True:
        time.sleep(0.1)


def fail():
    raise ValueError("rank function failed on purpose")


def test_ranks_are_torchruns_workers_with_their_own_output_and_the_tests_environment():
    results = run_ranks(report, 2, args=("hi",), patches=False, timeout=120,
                        env={"SATP_PROBE": "probe-value", "LOCAL_WORLD_SIZE": "8"})
    for rank, r in enumerate(results):
        assert r.ok, r.output[-3000:]
        assert r.stdout == f"out hi rank {rank}\n" and r.stderr == f"err hi rank {rank}\n"
        got = r.result
        assert got["torchrun"] and got["env"] == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "SATP_PROBE": "probe-value",
            "LOCAL_WORLD_SIZE": "8"}  # the test's value over torchrun's own
        assert got["stdin"] == os.devnull and got["cwd"] == os.getcwd()
    assert results[0].result["pid"] != results[1].result["pid"]


def test_a_rank_killed_by_sigkill_reports_minus_9_and_torchrun_ends_its_node():
    killed, stopped = run_ranks(kill_rank_1, 2, patches=False, timeout=120)[::-1]
    assert killed.returncode == -signal.SIGKILL and not killed.timed_out and killed.result is None
    assert "about to SIGKILL myself" in killed.stdout
    assert stopped.returncode == -signal.SIGTERM and not stopped.timed_out and "outlived" not in stopped.stdout


@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
def test_a_rank_on_another_node_outlives_a_killed_one():
    survivor, killed = run_ranks(kill_rank_1, 2, patches=False, nodes=2, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert survivor.returncode == 1 and survivor.stdout == "outlived rank 1\n" and not survivor.timed_out
    assert "SystemExit: 5" in survivor.exception


def test_a_failing_function_and_a_script_exit_code(tmp_path):
    [r] = run_ranks(fail, 1, patches=False, timeout=120)
    assert r.returncode == 1 and "rank function failed on purpose" in r.exception and not r.timed_out
    script = tmp_path / "exits.py"
    script.write_text("import os, sys\nprint('script rank', os.environ['RANK'], os.getcwd())\nsys.exit(3)\n")
    [s] = run_script([str(script)], nranks=1, patches=False, timeout=120, cwd=str(tmp_path))
    assert s.returncode == 3 and s.stdout == f"script rank 0 {tmp_path}\n"
    script.write_text("raise KeyError('uncaught in the script')\n")
    [u] = run_script([str(script)], nranks=1, patches=False, timeout=120)
    assert u.returncode == 1 and "KeyError: 'uncaught in the script'" in u.stderr


@pytest.mark.slow  # SAT imported on two ranks
def test_patched_and_stock_ranks_differ():
    patched, stock = (run_ranks(patch_state, 1, timeout=180, patches=p)[0] for p in (True, "stock"))
    assert patched.result == {"is_patched": True, "sat_has_replacement": True, "code_file": "registry.py"}, \
        patched.output[-3000:]
    assert stock.result == {"is_patched": False, "sat_has_replacement": False, "code_file": "data.py"}, \
        stock.output[-3000:]


@pytest.mark.slow  # waits for the timeout
def test_a_hanging_rank_is_killed_at_the_timeout_after_its_faulthandler_dump():
    started = time.monotonic()
    [r] = run_ranks(hang, 1, args=(0.5,), patches=False, timeout=8)
    assert time.monotonic() - started < 60     # its start-up (not counted by the timeout), 8 s, no more
    assert r.timed_out and r.returncode == -signal.SIGKILL and not r.ok
    assert "hanging" in r.stdout
    assert "Thread 0x" in r.stderr or "Current thread 0x" in r.stderr, r.stderr[-2000:]
    assert "in hang" in r.stderr


def test_uneven_nodes_are_refused():
    with pytest.raises(ValueError, match="3 ranks do not split evenly over 2 node"):
        run_ranks(fail, 3, nodes=2)


def test_code_runs_in_a_fresh_interpreter_with_the_test_kit_on_its_path(tmp_path, monkeypatch):
    code = ("import os, sys\n"
            "print('MODULES', [m in sys.modules for m in ('sat', 'sat_patches', 'torch')], os.environ['MARK'],"
            " os.getcwd(), sys.argv)\n"
            "import multirank\n"
            "sys.stderr.write('to stderr')\n"
            "raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    out = run_fresh(code, {"MARK": "x1"})
    assert out.returncode == 3 and out.stderr == "to stderr"
    assert f"MODULES [False, False, False] x1 {tmp_path} ['-c']" in out.stdout
    assert multirank.base_env()["OMP_NUM_THREADS"] == "1"
