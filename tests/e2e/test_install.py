"""What a user installs: an editable install behaves like a wheel (the start-up hook included)."""
import os
import subprocess
import sys

import pytest

from isolated import dependencies_without_us, tracked_copy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_editable_install_lets_import_sat_come_first_without_triton(tmp_path):
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    src, deps, venv = tmp_path / "src", tmp_path / "deps", tmp_path / "venv"
    tracked_copy(ROOT, str(src))
    dependencies_without_us(str(deps))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = dict(os.environ, PYTHONPATH=str(deps), PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # the venv has no pip of its own: this interpreter's pip installs into it (--prefix of the venv)
    out = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(src)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    probe = ("import importlib.util, sys\n"
             "assert importlib.util.find_spec('triton') is None, 'this test needs a machine without triton'\n"
             "import sat\n"
             "import sat_patches\n"
             "print('FROM', sat_patches.__file__)\n")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"FROM {src}" in out.stdout

