"""The verbs' processes (``python -m sat_patches merge`` and the like) exit as Python does, with their status: the
exit handlers and the interpreter's teardown run. Nothing in the library ends its process with ``os._exit`` but the
hang watchdog's fault path."""
import os
import pathlib
import subprocess
import sys

import pytest

import sat_patches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the verb's module run as ``python -m`` runs it, after an exit handler and an object only the teardown finalises
PROGRAM = """
import atexit, os, runpy, sys

class Finalised:
    def __del__(self, write=os.write):  # os itself may be gone by then
        write(1, b"teardown ran\\n")

kept = Finalised()
atexit.register(lambda: print("exit handler ran", flush=True))
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # each imports torch and SAT
@pytest.mark.parametrize("command", [["sat_patches", "merge"], ["sat_patches", "export", "hf"],
                                     ["sat_patches.runner.checkout_cpu"]], ids=["merge", "export", "checkout_cpu"])
def test_a_verb_exits_with_its_status_after_its_exit_handlers_and_the_teardown(command):
    out = subprocess.run([sys.executable, "-c", PROGRAM, *command, "--no-such-option"], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 2 and "usage:" in out.stderr, out.stderr[-3000:]  # argparse's
    assert out.stdout.splitlines() == ["exit handler ran", "teardown ran"], out.stdout


# the fault path: a hung collective's report ends the rank at once, its threads stuck in the collective
FAULT_PATH = {"diagnostics/watchdog.py"}


def test_no_module_ends_its_process_without_the_interpreters_exit_but_the_fault_path():
    package = pathlib.Path(sat_patches.__file__).parent
    ending = {str(p.relative_to(package)) for p in package.rglob("*.py") if "os._exit(" in p.read_text()}
    ending -= {"testing/_rank_main.py"}  # the test harness's rank, not the library's
    assert ending == FAULT_PATH
