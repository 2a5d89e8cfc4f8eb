"""The fork server behind run_ranks/run_script: forked ranks are captured, timed out, killed and
patched like fresh processes, and the rule sends import-time-sensitive environments to fresh ones."""
import os
import signal
import sys
import time

import pytest

import zygote
from sat_patches.testing import multirank, run_ranks, run_script

pytestmark = pytest.mark.multirank


def report(marker):
    """Rank function: what the rank sees of its process, environment and output streams."""
    print(f"out {marker} rank {os.environ['RANK']}")
    print(f"err {marker} rank {os.environ['RANK']}", file=sys.stderr)
    return {"rank": os.environ["RANK"], "probe": os.environ.get("SATP_PROBE"), "pid": os.getpid(),
            "session_leader": os.getsid(0) == os.getpid(), "stdin": os.readlink("/proc/self/fd/0"),
            "cwd": os.getcwd(), "path0": sys.path[0], "argv0": os.path.basename(sys.argv[0]),
            "omp": os.environ["OMP_NUM_THREADS"]}


def patch_state():
    """Rank function: is SAT's broadcast_data ours, and which function object is on SAT's module."""
    import sat.mpu.data
    import sat_patches
    from sat_patches.core.registry import REGISTRY
    patch = REGISTRY.get("broadcast_data_device")
    return {"is_patched": sat_patches.is_patched("broadcast_data_device"),
            "sat_has_replacement": sat.mpu.data.broadcast_data is patch.replacement,
            "code_file": os.path.basename(sat.mpu.data.broadcast_data.__code__.co_filename)}


def kill_self():
    print("about to SIGKILL myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def hang(dump_after):
    """Never returns; faulthandler dumps the stacks to stderr first, as the hang patches do."""
    import faulthandler
    faulthandler.dump_traceback_later(dump_after, exit=False, file=sys.stderr)
    print("hanging", flush=True)
    while True:
        time.sleep(0.1)


def fail():
    raise ValueError("rank function failed on purpose")


@pytest.mark.slow  # several launches (over 10 s)
def test_forked_ranks_have_their_own_output_environment_and_session():
    results = run_ranks(report, 2, args=("hi",), timeout=120, env={"SATP_PROBE": "probe-value"})
    assert [r.forked for r in results] == [True, True], [r.fresh_reason for r in results]
    for rank, r in enumerate(results):
        assert r.ok, r.output[-3000:]
        assert r.stdout.endswith(f"out hi rank {rank}\n") and r.stderr.endswith(f"err hi rank {rank}\n")
        got = r.result
        assert got["rank"] == str(rank) and got["probe"] == "probe-value" and got["omp"] == "1"
        assert got["session_leader"] and got["stdin"] == os.devnull
        assert got["cwd"] == os.getcwd() == got["path0"] and got["argv0"] == "_rank_main.py"
    assert results[0].result["pid"] != results[1].result["pid"]


@pytest.mark.slow  # starts the stock fork server (~10 s); tests/e2e/test_training.py's stock run uses it fast
def test_patched_and_stock_forked_ranks_differ():
    [patched] = run_ranks(patch_state, 1, timeout=120)
    [stock] = run_ranks(patch_state, 1, timeout=120, patches="stock")
    assert patched.forked and stock.forked
    assert patched.result == {"is_patched": True, "sat_has_replacement": True, "code_file": "devices.py"}
    assert stock.result == {"is_patched": False, "sat_has_replacement": False, "code_file": "data.py"}


def test_a_rank_killed_by_sigkill_reports_minus_9():
    [r] = run_ranks(kill_self, 1, timeout=120)
    assert r.forked and r.returncode == -signal.SIGKILL and not r.timed_out
    assert "about to SIGKILL myself" in r.stdout and r.result is None


@pytest.mark.slow
def test_a_hanging_rank_is_killed_at_the_timeout_after_its_faulthandler_dump():
    started = time.monotonic()
    [r] = run_ranks(hang, 1, args=(0.5,), timeout=8)  # room for the rank's own imports on a busy machine
    assert time.monotonic() - started < 30
    assert r.forked and r.timed_out and r.returncode == -signal.SIGKILL and not r.ok
    assert "hanging" in r.stdout
    assert "Thread 0x" in r.stderr or "Current thread 0x" in r.stderr, r.stderr[-2000:]
    assert "in hang" in r.stderr


def test_a_failing_function_and_a_script_exit_code(tmp_path):
    [r] = run_ranks(fail, 1, timeout=120)
    assert r.forked and r.returncode == 1 and "rank function failed on purpose" in r.exception
    script = tmp_path / "exits.py"
    script.write_text("import os, sys\nprint('script rank', os.environ['RANK'])\nsys.exit(3)\n")
    [s] = run_script([str(script)], nranks=1, timeout=120)
    assert s.forked and s.returncode == 3 and s.stdout == "script rank 0\n"
    script.write_text("raise KeyError('uncaught in the script')\n")
    [u] = run_script([str(script)], nranks=1, timeout=120)
    assert u.forked and u.returncode == 1 and "KeyError: 'uncaught in the script'" in u.stderr


@pytest.mark.parametrize("change, expect", [
    ({"SAT_PATCHES_DISABLE": "triton_rotary_import"}, "triton_rotary_import"),
    ({"SAT_PATCHES_DISABLE": "lora_linear,all"}, "all"),
    ({"SAT_PATCHES_IMPORT": "0"}, "SAT_PATCHES_IMPORT"),
    ({"PYTHONHASHSEED": "0"}, "PYTHONHASHSEED"),
    ({"OMP_NUM_THREADS": "2"}, "OMP_NUM_THREADS"),
    ({"TORCH_LOGS": "dynamo"}, "TORCH_LOGS"),
    ({"HF_HOME": "/elsewhere"}, "HF_HOME"),
    ({"SAT_PATCHES_DISABLE": ",".join(multirank.stock_disable())}, None),   # stock runs fork
    ({"RANK": "5", "MASTER_PORT": "1234", "KILL_RANK": "1", "SAT_PATCHES_HEARTBEAT_TIMEOUT": "3"}, None),
])
def test_the_fallback_rule(change, expect):
    base = multirank._base_env()
    env = {**multirank._rank_env(0, 1, 1234, True, None), **change}
    reason = zygote.fresh_reason(env, base)
    assert (reason is None) if expect is None else (expect in reason), reason


def test_callers_can_ask_for_fresh_processes(monkeypatch):
    base = multirank._base_env()
    cmd = [sys.executable, "-m", "sat_patches.testing._rank_main", "x", "y"]
    env = multirank._rank_env(0, 1, 1234, True, None)
    assert zygote.start(cmd, env, "/dev/null", "/dev/null", base, fresh=True) == (None, "fresh=True")
    monkeypatch.setenv(zygote.FRESH_ENV, "1")
    assert zygote.start(cmd, env, "/dev/null", "/dev/null", base) == (None, "SAT_PATCHES_TEST_FRESH=1")
    monkeypatch.delenv(zygote.FRESH_ENV)
    _, reason = zygote.start([sys.executable, "script.py"], env, "/dev/null", "/dev/null", base)
    assert "python -m" in reason


@pytest.mark.slow  # a fresh interpreter
def test_an_import_time_environment_gets_a_fresh_process_that_honours_it():
    [r] = run_ranks(report, 1, args=("fresh",), timeout=180, env={"PYTHONHASHSEED": "0"})
    assert r.ok, r.output[-3000:]
    assert not r.forked and "PYTHONHASHSEED" in r.fresh_reason
    assert r.stdout.endswith("out fresh rank 0\n") and r.result["session_leader"]


@pytest.mark.slow  # a fresh interpreter
def test_code_before_sat_runs_where_neither_sat_nor_sat_patches_is_imported(tmp_path, monkeypatch):
    code = ("import os, sys\n"
            "print('MODULES', [m in sys.modules for m in ('sat', 'sat_patches', 'torch')], os.environ['MARK'],"
            " os.getcwd(), sys.argv)\n"
            "sys.stderr.write('to stderr')\n"
            "raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    out = zygote.run_before_sat(code, {"MARK": "x1"})
    assert out.returncode == 3 and out.stderr == "to stderr"
    forked = zygote.failure(zygote.BEFORE_SAT) is None
    # forked from the server: its third-party imports are there, SAT and sat_patches are not
    assert f"MODULES [False, False, {forked}] x1 {tmp_path} ['-c']" in out.stdout
    assert zygote.run_before_sat("import sat_patches, sat; print(sat_patches.is_patched('lora_linear'))"
                                 ).stdout.strip() == "True"


def test_a_departed_clients_rank_is_killed_even_before_it_made_its_process_group():
    """A rank's first act is ``setsid``; a client that leaves right after asking for it may be dropped before the
    rank has run at all, when its process group does not exist yet: the rank is killed by its pid then."""
    import socket
    import subprocess
    import _zygote_server as server
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in this process's group
    client, other = socket.socketpair()
    try:
        assert os.getpgid(rank.pid) != rank.pid
        clients, live = {client}, {rank.pid: (client, 1)}
        server._drop(client, clients, live)
        assert rank.wait(30) == -signal.SIGKILL and not clients
    finally:
        rank.kill(), other.close()


def test_the_test_processes_of_a_session_share_one_server_each_told_of_its_own_ranks(tmp_path):
    """Two clients (as two xdist workers of one session) reach one server; each hears of its own ranks' exits only,
    a client's departure kills its ranks and not the other's, and the server exits after its last client. A second
    server started for a taken address stops at once (``LOST``)."""
    import subprocess
    import time
    env = dict(os.environ, PYTEST_XDIST_TESTRUNUID=f"shared-{os.getpid()}-{time.monotonic_ns()}")
    preload = ("json",)  # a light server: this checks the sharing, not the imports
    a, b = zygote.ForkServer(env, preload), zygote.ForkServer(env, preload)
    try:
        assert a.pid == b.pid and a.name == b.name == zygote.address(env, preload)
        assert zygote.address(dict(env, OMP_NUM_THREADS="7"), preload) != a.name  # another import-time environment
        lost = subprocess.run([sys.executable, "-c", zygote.LOADER, zygote.SERVER, a.name, "json"], env=env,
                              timeout=60)
        assert lost.returncode == zygote.LOST
        out = str(tmp_path / "out")
        quick = b.spawn([sys.executable, "-c", "raise SystemExit(4)"], env, out, out)
        held = a.spawn([sys.executable, "-c", "import time; time.sleep(60)"], env, out, out)
        assert quick.wait(30) == 4 and held.poll() is None and quick._id not in a.exits
        a.close()  # its rank is killed; b's connection still serves
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(held.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the departed client's rank still runs")
        assert b.spawn([sys.executable, "-c", "pass"], env, out, out).wait(30) == 0
    finally:
        a.close(), b.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not zygote._unbound(b.name):
        time.sleep(0.1)
    assert zygote._unbound(b.name)  # the server exited after its last client
