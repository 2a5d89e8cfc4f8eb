"""What a user installs: the wheel (and an editable install) change nothing in an interpreter that does not import
sat_patches; one that does gets SAT's triton module served on a machine without triton."""
import glob
import os
import subprocess
import sys

import pytest

import sat_patches

from isolated import dependencies_without_us, tracked_copy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

UNTOUCHED = ("import importlib.util, sys; print('PROBE', importlib.util.find_spec('xformers'), "
             "sorted(m for m in sys.modules if 'sat_patches' in m))")
USED = ("import importlib.util, sys\n"
        "assert importlib.util.find_spec('triton') is None, 'this test needs a machine without triton'\n"
        "import sat_patches, sat\n"
        "print('FROM', sat_patches.__file__, sat_patches.is_patched('lora_linear'))\n")


def _install(tmp_path, editable: bool):
    """A new venv holding this interpreter's packages but sat_patches, and sat_patches installed from a fresh copy of
    the repository's tracked files (as a wheel, or ``-e``)."""
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    src, deps, venv = tmp_path / "src", tmp_path / "deps", tmp_path / "venv"
    tracked_copy(ROOT, str(src))
    dependencies_without_us(str(deps))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = dict(os.environ, PYTHONPATH=str(deps), PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    target = ["-e", str(src)] if editable else [str(src)]
    # the venv has no pip of its own: this interpreter's pip (on PYTHONPATH) installs into it
    out = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", *target],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    site = glob.glob(str(venv / "lib" / "python*" / "site-packages"))[0]
    return python, env, site, src


def _run(python, env, code, cwd):
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # a wheel built and installed into a new venv, two fresh interpreters (~20 s)
def test_the_wheel_changes_nothing_until_imported(tmp_path):
    python, env, site, _ = _install(tmp_path, editable=False)
    assert [f for f in os.listdir(site) if f.endswith(".pth")] == []
    assert "PROBE None []" in _run(python, env, UNTOUCHED, tmp_path)
    out = _run(python, env, USED, tmp_path)
    assert f"FROM {site}" in out and out.rstrip().endswith("True"), out


@pytest.mark.slow
def test_an_editable_install_runs_the_checkout_and_changes_nothing_until_imported(tmp_path):
    python, env, site, src = _install(tmp_path, editable=True)
    assert [f for f in os.listdir(site) if f.endswith(".pth") and not f.startswith("__editable__")] == []
    # setuptools' own finder of editable installs is all there is (its name holds the project's)
    finder = f"__editable___sat_patches_{sat_patches.__version__.replace('.', '_')}_finder"
    assert f"PROBE None [{finder!r}]" in _run(python, env, UNTOUCHED, tmp_path)
    assert f"FROM {src}" in _run(python, env, USED, tmp_path)
