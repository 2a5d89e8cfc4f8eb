"""The one import hook: callbacks after an import, a package's own imports counted, stand-ins served; Python's own
loaders wrapped, never changed."""
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

import sat_patches
from sat_patches.core.import_hook import ImportHook

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(sat_patches.__file__)))


@pytest.fixture
def package(tmp_path, monkeypatch):
    """``hookpkg`` (``a`` imports ``target`` and then ``b``) and a module ``target``, on the path; a hook of its own."""
    root = tmp_path / "hookpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("import target\nfrom hookpkg import b\nAFTER_B = True\n")
    (root / "b.py").write_text("B = 1\n")
    (tmp_path / "target.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = ImportHook(package="hookpkg")
    yield hook
    if hook in sys.meta_path:
        sys.meta_path.remove(hook)
    for name in [n for n in sys.modules if n == "target" or n.startswith("hookpkg")]:
        del sys.modules[name]


def test_after_an_import_the_callback_runs_and_the_loader_is_pythons_own_unchanged(package):
    seen = []
    package.after("target", lambda: seen.append(sys.modules["target"].VALUE))
    package.arm()
    module = importlib.import_module("target")
    assert seen == [42]
    real = module.__spec__.loader.loader
    assert type(module.__loader__) is type(real) and "exec_module" not in vars(real)
    assert "VALUE = 42" in importlib.util.find_spec("target").loader.get_source("target")


def test_a_target_imported_inside_our_own_module_calls_back_once_that_module_is_done(package):
    order = []
    package.counting_own = True
    package.after("target", lambda: package.when_own_imports_done(
        lambda: order.append(getattr(sys.modules["hookpkg.a"], "AFTER_B", "half-imported"))))
    package.arm()
    importlib.import_module("hookpkg.a")
    assert order == [True] and package.own_running == 0


def test_nothing_is_served_or_watched_until_asked(package):
    package.arm()
    assert package.find_spec("xformers") is None and package.find_spec("target") is None


def test_no_private_import_state_is_read():
    """CPython's ``__spec__._initializing`` is private: the hook counts its own imports instead."""
    for folder, _, files in os.walk(os.path.join(SOURCE, "sat_patches")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    assert "_initializing" not in f.read(), os.path.join(folder, name)


@pytest.mark.slow  # a fresh interpreter importing SAT (~5 s)
def test_sat_imported_first_from_a_module_of_ours_is_patched_once_that_module_is_done():
    code = ("import sys\n"
            "from sat_patches.checkpoints.loading import load_checkpoint\n"
            "import sat_patches, sat.arguments\n"
            "print('MARK', getattr(sat.arguments.get_args, '__sat_patches__', None), sat_patches._auto['pending'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=SOURCE))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MARK get_args_cpu_device False" in out.stdout
