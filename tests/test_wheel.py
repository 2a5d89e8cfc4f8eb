"""The wheel holds the library alone: the ``sat_patches`` package and its metadata, no test code, no start-up hook."""
import os
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_CODE = re.compile(r"__reduce__|os\.system")


def not_the_library(names, read):
    """What in a wheel (its file ``names``; ``read(name)`` gives a file's text) is not the library: each a line."""
    found = []
    for name in names:
        top = name.split("/")[0]
        if top != "sat_patches" and not re.fullmatch(r"sat_patches-[^/]+\.dist-info", top):
            found.append(f"{name}: outside the sat_patches package")
        if "testing" in name.split("/")[:-1] or name.startswith("tests/"):
            found.append(f"{name}: test code")
        if name.endswith(".pth"):
            found.append(f"{name}: a .pth start-up file")
        if name.endswith(".py") and TEST_CODE.search(read(name)):
            found.append(f"{name}: {TEST_CODE.search(read(name)).group(0)} (a test payload)")
    return found


def test_the_check_finds_each_kind_of_test_code():
    files = {"sat_patches/__init__.py": "", "sat_patches-0.2.0.dist-info/RECORD": "",
             "sat_patches/testing/run.py": "", "tests/test_x.py": "", "_boot.py": "", "sat_patches.pth": "import x",
             "sat_patches/payload.py": "def __reduce__(self): ...", "sat_patches/run.py": "os.system('true')"}
    found = not_the_library(files, files.__getitem__)
    assert found == ["sat_patches/testing/run.py: test code",
                     "tests/test_x.py: outside the sat_patches package", "tests/test_x.py: test code",
                     "_boot.py: outside the sat_patches package",
                     "sat_patches.pth: outside the sat_patches package", "sat_patches.pth: a .pth start-up file",
                     "sat_patches/payload.py: __reduce__ (a test payload)",
                     "sat_patches/run.py: os.system (a test payload)"]


def checkout_files(root):
    """The files a fresh clone of the working tree has (tracked, and new ones git does not ignore): no stale
    ``build/`` can reach the wheel."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return [rel for rel in out.split("\0") if rel and os.path.isfile(os.path.join(root, rel))]


@pytest.mark.slow  # builds the wheel: 5-10 s
def test_the_wheel_holds_the_library_alone(tmp_path):
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    src = tmp_path / "src"
    for rel in checkout_files(ROOT):
        os.makedirs(src / os.path.dirname(rel), exist_ok=True)
        with open(os.path.join(ROOT, rel), "rb") as f:
            (src / rel).write_bytes(f.read())
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "wheels"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    [wheel] = (tmp_path / "wheels").glob("sat_patches-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        found = not_the_library(names, lambda name: archive.read(name).decode("utf-8", "replace"))
    assert "sat_patches/__init__.py" in names
    assert found == []
