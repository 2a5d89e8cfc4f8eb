"""python -m sat_patches.launch applies the patches before the script, which runs as __main__."""
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
