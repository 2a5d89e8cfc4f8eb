"""sat_patches.runner.cpu_ranks: the CPU runs' ranks forked from one interpreter after the imports every rank makes,
each with torchrun's worker environment; a failing rank stops the others, a signal reaches every rank."""
import os
import signal
import subprocess
import sys
import time

import pytest

from sat_patches.core.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the launcher with nothing preloaded: what it does with the ranks, in a fraction of a second
BARE = ("import sys; from sat_patches.runner import cpu_ranks; cpu_ranks.PRELOAD = (); "
        "sys.exit(cpu_ranks.main(sys.argv[1:]))")


def launcher(tmp_path, rank_code, nproc=2, preload=False):
    (tmp_path / "satp_rank_module.py").write_text(rank_code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED"):  # what the launcher sets for its ranks
        env.pop(name, None)
    head = ["-m", "sat_patches.runner.cpu_ranks"] if preload else ["-c", BARE]
    cmd = [sys.executable, *head, "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           "-m", "satp_rank_module", "--flag", "value"]
    return cmd, env


def run(tmp_path, rank_code, **kw):
    cmd, env = launcher(tmp_path, rank_code, **kw)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


REPORT = """import os, sys
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS")
said = ("RANK-SAYS", __name__, sys.argv[1:], [os.environ.get(n) for n in names], os.environ["MASTER_PORT"],
        os.getppid(), [m in sys.modules for m in ("torch", "sat", "deepspeed", "torch._dynamo")])
# one write a line (each write reaches the pipe at once, as under python -u), and an exit without a flush
sys.stdout.write(" ".join(map(str, said)) + "\\n")
os._exit(0)
"""


def test_each_rank_runs_the_module_as_main_with_torchruns_variables_and_unbuffered_output(tmp_path):
    cmd, env = launcher(tmp_path, REPORT)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    said = sorted(l for l in out.stdout.splitlines() if l.startswith("RANK-SAYS"))
    port = cmd[cmd.index("--master-port") + 1]
    assert len(said) == 2, out.stdout
    for rank, line in enumerate(said):
        assert line.startswith(f"RANK-SAYS __main__ ['--flag', 'value'] ['{rank}', '{rank}', '2', '2', '127.0.0.1', "
                               f"'1'] {port} "), line


@pytest.mark.slow  # the real preload: torch, DeepSpeed, SAT, transformers and torch's compiler (about 6 s)
def test_a_rank_starts_with_what_every_rank_imports_already_imported(tmp_path):
    out = run(tmp_path, REPORT, preload=True)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [l for l in out.stdout.splitlines() if l.startswith("RANK-SAYS")]
    assert len(said) == 2 and all(l.endswith("[True, True, True, True]") for l in said), said
    parents = {l.split()[-5] for l in said}
    assert len(parents) == 1 and parents != {str(os.getpid())}, said  # both forked by the one launcher


def test_a_failing_rank_stops_the_others_and_its_status_is_the_launchers(tmp_path):
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
            "time.sleep(600)\n")
    out = run(tmp_path, code, nproc=3)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "sat_patches.runner.cpu_ranks: rank 1 exited with status 3: stopping the other 2 rank(s)" in out.stderr


def test_an_exception_in_a_rank_is_printed_and_exits_with_status_1(tmp_path):
    out = run(tmp_path, "raise RuntimeError('broken rank')\n", nproc=1)
    assert out.returncode == 1 and "RuntimeError: broken rank" in out.stderr, out.stderr[-3000:]
    assert "rank 0 exited with status 1" in out.stderr


def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path):
    code = ("import os, pathlib, time\n"
            f"pathlib.Path(r'{tmp_path}', 'ready' + os.environ['RANK']).write_text('')\n"
            "time.sleep(600)\n")
    cmd, env = launcher(tmp_path, code)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "exited with signal SIGTERM" in err


def test_the_command_line_needs_the_ranks_the_port_and_a_module(tmp_path):
    from sat_patches.runner import cpu_ranks
    opts = cpu_ranks.options(["--nproc-per-node", "2", "--master-port", "29500", "-m", "mod", "--x", "-y"])
    assert (opts.nproc_per_node, opts.master_port, opts.module, opts.args) == (2, 29500, "mod", ["--x", "-y"])
    for argv in (["--master-port", "1", "-m", "mod"], ["--nproc-per-node", "0", "--master-port", "1", "-m", "mod"],
                 ["--nproc-per-node", "2", "--master-port", "1", "-m"]):
        with pytest.raises(SystemExit):
            cpu_ranks.options(argv)


# one_process with nothing preloaded: the standby launcher's place in a CPU run, in a fraction of a second
STEPS = ("import sys; from sat_patches.runner import cpu_ranks, one_process; cpu_ranks.PRELOAD = (); "
         "sys.exit(one_process.main(sys.argv[1:]))")


def test_a_cpu_runs_ranks_are_forked_from_the_launcher_it_forked_before_its_steps(tmp_path):
    """The ranks' parent is the launcher that one_process forked before its first step ran (not a fresh
    interpreter: the ranks start from one_process's imports); what the first step wrote is there for them."""
    import json
    rank = ("import os, sys\n"
            f"assert os.path.exists(r'{tmp_path / 'prepared'}')\n"
            "parent = os.getppid()\n"
            "grandparent = int(open(f'/proc/{parent}/stat').read().rsplit(')', 1)[1].split()[1])\n"
            "started_as = open(f'/proc/{parent}/cmdline', 'rb').read().split(b'\\0')[1].decode()\n"
            "rank = os.environ['RANK']\n"
            "sys.stdout.write(f'RANK {rank} launcher {parent} under {grandparent} as {started_as}\\n')\n")
    cmd, env = launcher(tmp_path, rank, preload=True)  # the command line; one_process runs it with no preload
    steps = [[sys.executable, "-c", f"open(r'{tmp_path / 'prepared'}', 'w').close()"], cmd]
    proc = subprocess.Popen([sys.executable, "-c", STEPS, json.dumps(steps)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    said = sorted(l for l in out.splitlines() if l.startswith("RANK "))
    assert [l.split()[:2] for l in said] == [["RANK", "0"], ["RANK", "1"]], out
    [(launcher_pid, under, started_as)] = {(l.split()[3], l.split()[5], l.split()[7]) for l in said}
    assert under == str(proc.pid) != launcher_pid, said
    assert started_as == "-c", said  # a fork of one_process (python -c ...), not a python -m launcher of its own
    assert f"+ {sys.executable} -m sat_patches.runner.cpu_ranks --nproc-per-node 2 " in out


def test_an_unused_standby_launcher_ends_with_the_run(tmp_path):
    import json
    cmd, env = launcher(tmp_path, REPORT, preload=True)
    steps = [[sys.executable, "-c", "raise SystemExit(4)"], cmd]
    out = subprocess.run([sys.executable, "-c", STEPS, json.dumps(steps)], env=env, capture_output=True, text=True,
                         timeout=60)  # a launcher left waiting would hold the output open past the timeout
    assert out.returncode == 4 and "RANK-SAYS" not in out.stdout, out.stderr[-3000:]
