"""The GPU kit's part h (benchmarks/gpu/proof_recipes.py): the README's Hugging Face recipes on an export.

Only its skip logic is built: every recipe's row is skipped with what it needs (the remote code, transformers
and peft), or, with those present (here: the stand-in remote code of tests/support/cogvlm_hf_standin), with the
reason that the run is not built. Never ``ok``.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "benchmarks", "gpu")
STANDIN = os.path.join(ROOT, "tests", "support", "cogvlm_hf_standin")
sys.path[:0] = [KIT]

import proof_recipes  # noqa: E402


def test_the_reason_names_what_is_needed_then_that_the_run_is_not_built(tmp_path):
    assert "--hf-code DIR" in proof_recipes.why_skipped(None)
    assert "lacks" in proof_recipes.why_skipped(str(tmp_path))
    assert proof_recipes.why_skipped(STANDIN) == proof_recipes.NOT_BUILT


def test_every_recipe_row_is_skipped_with_the_reason():
    from proof_record import Recorder
    for hf_code, reason in ((None, "--hf-code DIR"), (STANDIN, proof_recipes.NOT_BUILT)):
        rec = Recorder("h")
        proof_recipes.run(rec, True, hf_code)
        assert len(rec.rows) == len(proof_recipes.RECIPES) == 3
        assert all(r.status.startswith("skipped: ") and reason in r.status for r in rec.rows), rec.rows


@pytest.mark.slow
def test_part_h_runs_in_the_kit_at_tiny_size_and_says_why_it_skips(tmp_path):
    out = tmp_path / "out"
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, SAT_PATCHES_DEVICE="cpu", PYTHONPATH=path)
    run = subprocess.run([sys.executable, os.path.join(KIT, "proof.py"), "--tiny", "--parts", "h", "--out", str(out),
                          "--time-scale", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    rows = json.loads((out / "proof.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["h"] * 3
    assert all(r["status"].startswith("skipped: needs --hf-code DIR") for r in rows), rows
