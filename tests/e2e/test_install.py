"""What a user installs: an editable install behaves like a wheel (the start-up hook included)."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = ("sat_patches", "_sat_patches_boot", "__editable__")


def _tracked_copy(dest):
    """The checkout's tracked files (what a fresh clone has), copied to ``dest``."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))


def _dependencies_without_us(dest):
    """This interpreter's installed packages, minus sat_patches and every .pth start-up file: a path
    entry for a fresh virtual environment that has SAT, torch and setuptools but no trace of us."""
    site = sysconfig.get_paths()["purelib"]
    os.makedirs(dest)
    for name in os.listdir(site):
        if not (name.startswith(OURS) or name.endswith(".pth")):
            os.symlink(os.path.join(site, name), os.path.join(dest, name))


@pytest.mark.slow
def test_editable_install_lets_import_sat_come_first_without_triton(tmp_path):
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    src, deps, venv = tmp_path / "src", tmp_path / "deps", tmp_path / "venv"
    _tracked_copy(src)
    _dependencies_without_us(str(deps))
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


def test_one_version_everywhere():
    """The installed distribution, the package and the README's requirement line say the same version."""
    import re
    from importlib import metadata
    import sat_patches
    assert metadata.version("sat_patches") == sat_patches.__version__
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert re.findall(r"^sat_patches==(\S+)$", readme, re.M) == [sat_patches.__version__]
    assert f"sat_patches.git@v{sat_patches.__version__}" in readme
