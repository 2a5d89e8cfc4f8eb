"""The command-line tools and the finetune scripts' pre-launch checks start without torch or SAT."""
import json
import os
import subprocess
import sys

import pytest

import sat_patches

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(sat_patches.__file__)))  # this checkout, or site-packages

PROBE = """
import runpy, sys
module, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("LOADED " + " ".join(m for m in ("torch", "sat", "deepspeed", "transformers") if m in sys.modules),
      file=sys.stderr)
"""


@pytest.mark.parametrize("argv, says", [
    (["sat_patches", "plan", "--model", "cogvlm-base-490", "--gpus", "2", "--gpu-mem", "24", "--json"], None),
    (["sat_patches", "report", "no-such-run"], "no memory_ledger.csv in no-such-run"),
    (["sat_patches.tools.finetune_check"], "MP_SIZE=3 does not divide"),
    (["sat_patches", "merge"], "usage: sat-patches merge"),
    (["sat_patches", "evaluate", "ckpt"], "the following arguments are required: data, --local_tokenizer"),
    (["sat_patches", "finetune", "verify"], "usage: sat-patches finetune verify"),
], ids=["plan", "report", "finetune_check", "merge", "evaluate", "finetune"])
def test_tool_imports_neither_torch_nor_sat(argv, says, tmp_path):
    env = dict(os.environ, NUM_GPUS_PER_WORKER="2", MP_SIZE="3", CUDA_VISIBLE_DEVICES="0,1",
               PYTHONPATH=SOURCE)
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)
    loaded = [l for l in out.stderr.splitlines() if l.startswith("LOADED")]
    assert loaded == ["LOADED "], out.stderr[-2000:]
    if says is None:
        assert json.loads(out.stdout)["model"] == "cogvlm-base-490"
    else:
        assert says in out.stderr
