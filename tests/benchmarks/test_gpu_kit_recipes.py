"""The GPU kit's part h (benchmarks/gpu/proof_recipes.py): the README's Hugging Face recipes on an export.

* without the remote code (or transformers and peft) every recipe's row is skipped with what it needs;
* at tiny size on CPU (slow tier), against a stand-in remote code of our own (tests/support/cogvlm_hf_standin:
  the released parameter names and call; upstream's code is not ours to ship): the kit-made model is exported
  (``export hf --hf-code``, ``export peft``), the fp32 load gives SAT's logits and generates, the PEFT adapter on
  the exported base gives SAT's logits with LoRA, and the 4-bit load is beside the fp32 load's logits or skipped
  with what refused it.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "benchmarks", "gpu")
STANDIN = os.path.join(ROOT, "tests", "support", "cogvlm_hf_standin")
sys.path[:0] = [KIT]

import proof_recipes  # noqa: E402


def test_the_reason_names_what_is_needed(tmp_path):
    assert "--hf-code DIR" in proof_recipes.why_skipped(None)
    assert "lacks" in proof_recipes.why_skipped(str(tmp_path))
    assert proof_recipes.why_skipped(STANDIN) == ""


def test_without_the_remote_code_every_recipe_row_is_skipped_with_the_reason(tmp_path):
    from proof_record import Recorder
    for hf_code, reason in ((None, "--hf-code DIR"), (str(tmp_path), "lacks modeling_cogvlm.py")):
        rec = Recorder("h")
        proof_recipes.run(rec, True, hf_code)
        assert len(rec.rows) == len(proof_recipes.RECIPES) == 3
        assert all(r.status.startswith("skipped: ") and reason in r.status for r in rec.rows), rec.rows


@pytest.mark.slow
def test_part_h_runs_the_recipes_at_tiny_size_on_cpu(tmp_path):
    from kit_part import run_part  # (transformers' remote-code cache is the session's: tests/conftest.py)
    data, _ = run_part("h", tmp_path, "--hf-code", STANDIN)
    rows = data["rows"]
    export, plain, four, adapter = rows
    assert export["status"] == "ok" and "export peft: 8 layers" in export["measured"], export
    assert plain["status"] == "ok" and "fp32 (tiny, CPU)" in plain["check"], plain
    assert "max |HF - SAT|" in plain["measured"] and "generate: [" in plain["detail"], plain
    assert adapter["status"] == "ok" and "8 adapted modules" in adapter["detail"], adapter
    # 4-bit: beside the fp32 load where bitsandbytes runs on the CPU, else skipped with what refused it
    assert four["status"] == "ok" or four["status"].startswith("skipped: 4-bit load on CPU refused: "), four
    if four["status"] == "ok":
        assert "Linear4bit" in four["detail"] and float(four["measured"].split()[1]) >= proof_recipes.COSINE_4BIT


def test_on_the_gpu_the_model_has_full_widths_and_two_layers():
    full, tiny = proof_recipes.model_config(False), proof_recipes.model_config(True)
    assert (full["num_layers"], full["eva_args"]["num_layers"]) == (proof_recipes.LAYERS,) * 2 == (2, 2)
    assert (full["hidden_size"], full["vocab_size"], full["eva_args"]["hidden_size"]) == (4096, 32000, 1792)
    assert tiny["hidden_size"] < full["hidden_size"]
