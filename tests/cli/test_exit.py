"""``sat_patches.cli.exit_now``: a verb's process exits with its status, its output flushed, without the
interpreter's teardown; a process alone in its process group (SAT's model-only group, as ``merge`` makes) runs its
exit handlers first (the group destroyed, a save lock given back)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = """
import atexit, os, sys
import torch.distributed as dist
from sat_patches.cli import exit_now

class Finalised:
    def __del__(self, write=os.write):  # os itself may be gone by then
        write(1, b"teardown ran\\n")

kept = Finalised()  # collected in the interpreter's teardown only
if sys.argv[1] == "group":
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
atexit.register(lambda: print("exit handler ran; group still there:", dist.is_initialized(), flush=True))
print("buffered output", end="")
exit_now(3)
"""


@pytest.mark.slow
@pytest.mark.parametrize("group", ["group", "none"], ids=["one-process-group", "no-group"])
def test_exit_now_skips_the_teardown_and_runs_exit_handlers_where_a_group_is_there(tmp_path, group):
    out = subprocess.run([sys.executable, "-c", PROGRAM, group, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 3, out.stderr[-3000:]
    assert out.stdout.startswith("buffered output") and "teardown ran" not in out.stdout, out.stdout
    if group == "group":  # the handlers ran, in a normal exit's order (the group's own handler is not ours here)
        assert "exit handler ran; group still there: True" in out.stdout
    else:  # a verb without a group: nothing else runs, as before
        assert "exit handler ran" not in out.stdout


VERB = """
import os, runpy, sys

class Finalised:
    def __del__(self, write=os.write):
        write(1, b"teardown ran\\n")

kept = Finalised()
sys.argv = ["sat_patches", *sys.argv[1:]]
runpy.run_module("sat_patches", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("verb, quick", [(["finetune"], True), (["report", "no-such-run"], False)],
                         ids=["own-parser-verb", "other-verb"])
def test_python_m_sat_patches_exits_without_the_teardown_after_a_verb_with_its_own_parser(verb, quick):
    """``python -m sat_patches finetune ...`` (a verb that loads torch and SAT) ends as ``exit_now`` ends it; a
    verb that loads neither exits normally."""
    out = subprocess.run([sys.executable, "-c", VERB, *verb], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 2, out.stderr[-3000:]
    assert ("teardown ran" in out.stdout) is not quick, out.stdout
