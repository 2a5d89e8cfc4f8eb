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
    (["sat_patches.runner.finetune_check"], "MP_SIZE=3 does not divide"),
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


def test_the_runner_prints_a_runs_evaluations_without_torch_or_sat(tmp_path):
    """After a run, the finetune script's last lines (exact match before and after training) cost no torch or
    SAT start-up (about 10 s on a CPU machine)."""
    import json
    for folder, exact in (("evaluation_before_training", 0), ("evaluation", 3)):
        os.makedirs(tmp_path / folder)
        summary = {"samples": 4, "exact_match": exact, "accuracy": exact / 4, "char_accuracy": 0.5, "data": "v.jsonl"}
        (tmp_path / folder / "summary.json").write_text(json.dumps(summary))
    code = (f"import sys; from sat_patches.runner.finetune_run import print_evaluations; "
            f"print_evaluations({str(tmp_path)!r}); "
            "print('LOADED ' + ' '.join(m for m in ('torch', 'sat') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=SOURCE))
    assert out.returncode == 0 and "LOADED \n" in out.stderr + "\n", out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "evaluation before training: exact match 0/4 (0.0%), characters 50.0% on v.jsonl",
        "evaluation: exact match 3/4 (75.0%), characters 50.0% on v.jsonl"]
