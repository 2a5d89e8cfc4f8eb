"""python -m sat_patches.launch applies the patches before the script, which runs as __main__."""
import os
import subprocess
import sys

import pytest

from sat_patches.launch import split_launcher_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys
import sat_patches
assert __name__ == "__main__"
print("ARGV", sys.argv[1:])
print("APPLIED", all(r["status"] in ("applied", "waiting") for r in sat_patches.status()))
"""


@pytest.mark.slow  # a fresh interpreter
def test_launch_runs_script_as_main_with_patches(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "sat_patches.launch", str(script), "--lr", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ARGV ['--lr', '1']" in out.stdout and "APPLIED True" in out.stdout


def test_deepspeed_local_rank_goes_behind_the_script():
    assert split_launcher_args(["--local_rank=1", "train.py", "--lr", "1"]) == \
        (("path", "train.py"), ["--lr", "1", "--local_rank=1"])
    assert split_launcher_args(["-m", "pkg.mod", "x"]) == (("module", "pkg.mod"), ["x"])
    with pytest.raises(SystemExit, match="usage"):
        split_launcher_args(["--local_rank=0"])


def test_missing_script_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sat_patches.launch", str(tmp_path / "nope.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "no such script" in out.stderr


def test_a_module_runs_as_python_m_runs_it_and_a_missing_one_is_a_clear_error(tmp_path):
    (tmp_path / "satp_pkg").mkdir()
    (tmp_path / "satp_pkg" / "__init__.py").write_text("")
    (tmp_path / "satp_pkg" / "__main__.py").write_text(
        "import sys\nprint('RAN', __name__, __spec__.name, __package__, sys.argv[1:], "
        "sys.modules['__main__'].__file__ == __file__ == sys.argv[0])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "-m", "sat_patches.launch", "-m", "satp_pkg", "--lr", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "RAN __main__ satp_pkg.__main__ satp_pkg ['--lr', '1'] True" in out.stdout, \
        out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "sat_patches.launch", "-m", "satp_pkg.nope"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "sat_patches.launch: no module named satp_pkg.nope" in out.stderr, out.stderr


EXITING = """
import atexit, os, sys, threading, time
log = open(sys.argv[1], "w")  # left open, its last line unflushed: the exit must flush it
log.write("trained\\n")
atexit.register(lambda: open(sys.argv[1] + ".handler", "w").write("closed"))  # as tensorboard's writer registers


class Teardown:  # a module global's finaliser: runs in the interpreter's teardown only
    def __del__(self, write=os.write):  # (sys.stdout may be gone by then)
        write(1, b"TEARDOWN\\n")


teardown = Teardown()
if sys.argv[2] == "writer-thread":  # a thread the script started that still writes after the script returned
    def write_late():
        time.sleep(0.5)
        open(sys.argv[1] + ".late", "w").write("done")
    threading.Thread(target=write_late).start()
if sys.argv[2] == "own-group":  # a process group the script made itself (not through SAT) and left up
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
    destroy = dist.destroy_process_group

    def destroyed(*args, **kwargs):
        open(sys.argv[1] + ".destroyed", "w").write("yes")
        return destroy(*args, **kwargs)
    dist.destroy_process_group = destroyed
"""


@pytest.mark.parametrize("case", ["plain", "writer-thread", pytest.param("own-group", marks=pytest.mark.slow)])
def test_a_returned_script_exits_as_python_does_its_own_group_destroyed_first(tmp_path, case):
    """A rank whose script returned exits as Python does: its exit handlers, the threads it started and the
    interpreter's teardown (which flushes the files it left open) all run. A process group the script left up is
    destroyed first (left to the teardown, gloo's threads can abort the process)."""
    script, log = tmp_path / "train.py", tmp_path / "log.txt"
    script.write_text(EXITING)
    out = subprocess.run([sys.executable, "-m", "sat_patches.launch", str(script), str(log), case],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert log.read_text() == "trained\n" and (tmp_path / "log.txt.handler").read_text() == "closed"
    assert "TEARDOWN" in out.stdout, out.stdout
    if case == "writer-thread":
        assert (tmp_path / "log.txt.late").read_text() == "done"
    assert (tmp_path / "log.txt.destroyed").exists() == (case == "own-group")
