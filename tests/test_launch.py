"""python -m sat_patches.launch applies the patches before the script, which runs as __main__."""
import os
import subprocess
import sys

import pytest

from sat_patches.launch import split_launcher_args

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


EXITING = """
import atexit, sys, threading, time
log = open(sys.argv[1], "w")  # left open, its last line unflushed: the exit must flush it
log.write("trained\\n")
atexit.register(lambda: open(sys.argv[1] + ".handler", "w").write("closed"))  # as tensorboard's writer registers


class Teardown:  # a module global's finaliser: runs in the interpreter's teardown only
    def __del__(self):
        sys.stdout.write("TEARDOWN\\n")


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


@pytest.mark.parametrize("case", ["quick", "quick-off", "writer-thread",
                                  pytest.param("own-group", marks=pytest.mark.slow)])
def test_a_returned_script_exits_without_the_teardown_losing_nothing(tmp_path, case):
    """A rank whose script returned exits once its exit handlers ran and its open files are flushed, without the
    interpreter's teardown (seconds after torch, SAT and a model); with SAT_PATCHES_QUICK_EXIT=0, or a thread the
    script started still running, it exits as Python does. A process group the script left up is destroyed first
    (left to the teardown, gloo's threads can abort the process)."""
    script, log = tmp_path / "train.py", tmp_path / "log.txt"
    script.write_text(EXITING)
    env = dict(os.environ, SAT_PATCHES_QUICK_EXIT="0" if case == "quick-off" else "1")
    out = subprocess.run([sys.executable, "-m", "sat_patches.launch", str(script), str(log), case],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert log.read_text() == "trained\n" and (tmp_path / "log.txt.handler").read_text() == "closed"
    assert ("TEARDOWN" in out.stdout) == (case in ("quick-off", "writer-thread")), out.stdout
    if case == "writer-thread":
        assert (tmp_path / "log.txt.late").read_text() == "done"
    assert (tmp_path / "log.txt.destroyed").exists() == (case == "own-group")
