"""The GPU kit's peer part (benchmarks/gpu/proof_peer.py): the released model's HF code with PEFT beside SAT +
sat_patches, one step each at the same settings.

* its figures without a model (fast): useful FLOPs from the shapes, tokens/s, utilisation, the table, the ratio;
* without the HF code it says what it needs;
* at tiny size on CPU (slow tier), against a stand-in remote code of our own (tests/support/cogvlm_hf_standin:
  the released parameter names and call; upstream's code is not ours to ship): both stacks step, PEFT adapts
  the layers SAT's LoRA adapts, the table holds both with positive tokens/s.
"""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "benchmarks", "gpu")
STANDIN = os.path.join(ROOT, "tests", "support", "cogvlm_hf_standin")
sys.path[:0] = [KIT]

import peer_figures as figures  # noqa: E402


def full_cogvlm():
    from sat_patches.cogvlm.shapes import upstream_config
    return upstream_config("cogvlm-base-490")


def test_useful_flops_of_full_size_cogvlm_from_its_shapes():
    """2.9e13 FLOP forward per 1288-token sample; useful work (forward + input-gradient backward) twice that."""
    config = full_cogvlm()
    assert figures.forward_flops(config, 1288) == pytest.approx(2.90e13, rel=0.01)
    assert figures.useful_flops(config, 1288) == 2 * figures.forward_flops(config, 1288)
    parts = figures.forward_macs(config, 1288)
    assert max(parts, key=parts.get) == "language layers" and parts["EVA layers"] > parts["LM head"]
    # the same step (micro-batch 8, 1.913 s) at the measured 790 TFLOP/s a bf16 product reaches: 31%
    step = figures.StepFigures(figures.OURS, "s", 8, 1288, 1.913, 45.62e9, figures.useful_flops(config, 1288), 790e12)
    assert step.useful_flops_per_s == pytest.approx(242e12, rel=0.01)
    assert step.utilisation == pytest.approx(0.31, abs=0.01)
    assert step.tokens_per_s == pytest.approx(5386, rel=0.001)


def test_tiny_flops_follow_the_shapes():
    from sat_patches.cogvlm.config import tiny_config
    config = tiny_config("cogvlm")
    assert 0 < figures.forward_flops(config, 160) < figures.forward_flops(config, 320)
    wider = dict(config, hidden_size=2 * config["hidden_size"])
    assert figures.forward_flops(wider, 160) > figures.forward_flops(config, 160)


def test_table_sets_the_stacks_side_by_side_with_the_ratio_on_ours():
    rows = [figures.StepFigures(stack, figures.setting_name(mb, ckpt), mb, 1288, seconds, peak, 6e13, 790e12)
            for stack, mb, ckpt, seconds, peak in (
                (figures.PEER, 8, True, 1.916, 45.41e9), (figures.PEER, 1, False, 0.384, 46.59e9),
                (figures.OURS, 8, True, 1.913, 45.62e9), (figures.OURS, 1, False, 0.431, None))]
    ratio = figures.ratios(rows)
    assert ratio == {"micro-batch 8, every layer checkpointed": pytest.approx(1.916 / 1.913),
                     "micro-batch 1, no checkpointing": pytest.approx(0.384 / 0.431)}
    lines = figures.table(rows).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(figures.TABLE_COLUMNS)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[0] for c in cells] == [figures.PEER, figures.PEER, figures.OURS, figures.OURS]
    assert cells[0][2:5] == ["1.916 s", "5,378", "45.41 GB"] and cells[0][7] == ""
    assert cells[2][7] == "1.00x" and cells[3][7] == "0.89x" and cells[3][4] == "-"
    assert cells[2][6] == "32%"  # 8 x 6e13 / 1.913 s of 790 TFLOP/s
    assert json.dumps(figures.as_dicts(rows))  # what proof.json keeps


def test_prepare_carries_the_peer_wheels_apart():
    """The Hugging Face recipes' version set (the remote code predates the image's transformers 5.x, and the
    image's accelerate 1.x breaks the 4-bit recipe), with the huggingface-hub transformers needs: in a list of
    their own, installed apart, passed to parts p and h; bitsandbytes with the proof's own wheels."""
    import re
    from sat_patches import hf_recipes
    with open(os.path.join(KIT, "prepare.sh"), encoding="utf-8") as f:
        text = f.read()
    pins = re.search(r"^PEER_WHEELS=\(\n(.*?)^\)", text, re.M | re.S).group(1).split()
    wheels = re.search(r"^WHEELS=\(\n(.*?)^\)", text, re.M | re.S).group(1).split()
    assert set(pins) == {p for p in hf_recipes.PINS if not p.startswith("bitsandbytes")} | {"huggingface_hub==0.23.5"}
    assert f"bitsandbytes=={hf_recipes.pinned('bitsandbytes')}" in wheels
    assert "--target /tmp/peer .gpu-wheels/peer/*.whl" in text
    assert "--hf-code .gpu-wheels/hf-code --peer-site /tmp/peer" in text


def test_without_the_hf_code_the_part_says_what_it_needs(tmp_path):
    import proof_peer
    assert "--hf-code DIR" in proof_peer.missing(None) and "modeling_cogvlm.py" in proof_peer.missing(None)
    (tmp_path / "modeling_cogvlm.py").write_text("")
    assert proof_peer.missing(str(tmp_path)).endswith("lacks visual.py, configuration_cogvlm.py")
    assert proof_peer.missing(STANDIN) == ""


@pytest.mark.slow
@pytest.mark.multirank
def test_peer_part_runs_at_tiny_size_on_cpu(tmp_path):
    from kit_part import run_part
    data, output = run_part("p", tmp_path, "--hf-code", STANDIN)
    assert [r for r in data["rows"] if r["status"] != "ok"] == []
    table = data["peer_table"]
    settings = [figures.setting_name(mb, ckpt) for mb, ckpt in ((2, True), (1, False))]
    both = {(stack, setting) for stack in (figures.PEER, figures.OURS) for setting in settings}
    assert {(r["stack"], r["setting"]) for r in table} == both
    assert all(r["tokens_per_s"] > 0 and 0 < r["utilisation"] for r in table)
    # PEFT found the layers SAT's LoRA adapts: qkv and dense of 2 language and 2 EVA layers
    assert {r["lora_modules"] for r in table} == {8}
    assert "| stack | setting | step | tokens/s |" in output and "x |" in output
