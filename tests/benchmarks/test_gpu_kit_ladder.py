"""The GPU kit's speed ladder (benchmarks/gpu/proof_ladder.py): the peer and our step with each lever added in turn.

* its rungs come from the plan (fast): every layer fully checkpointed, then the plan's layers left out, the plan's
  fastest selective setting, the compiled layers; one micro-batch for all;
* the levers are set for a rung only, and the table holds what it measured;
* at tiny size on CPU (slow tier), against the stand-in of the released HF code (tests/support/cogvlm_hf_standin):
  every rung steps from the same LoRA weights, so their first losses agree; the peer's row and the ratios come.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STANDIN = os.path.join(ROOT, "tests", "support", "cogvlm_hf_standin")
sys.path[:0] = [os.path.join(ROOT, "benchmarks", "gpu")]

import proof_ladder  # noqa: E402


@pytest.mark.parametrize("memory_gb", [80, 141])
def test_the_rungs_are_the_plans_settings_with_one_lever_added_each(memory_gb):
    from sat_patches.cogvlm.shapes import upstream_config
    from sat_patches.planning import search, shapes
    config = upstream_config("cogvlm-base-490")
    ladder = proof_ladder.rungs(config, memory_gb, tiny=False)
    assert [r.name for r in ladder] == list(proof_ladder.RUNGS)
    routing, unchecked, selective, compiled = (r.setup for r in ladder)
    plan = search.recommend(search.options(shapes.plan_config(config), 1, memory_gb, selective=False, qlora=False))
    assert {s.micro_batch for s in (routing, unchecked, selective, compiled)} == {plan.estimate.setup.micro_batch}
    assert routing.checkpoint_activations and (routing.checkpoint_skip_layers, routing.selective_share) == (0, 0.0)
    assert unchecked.checkpoint_skip_layers == plan.estimate.setup.checkpoint_skip_layers
    assert selective.selective_share > 0 and ladder[2].levers["SAT_PATCHES_CHECKPOINT_SELECTIVE"]
    assert compiled.compiled and ladder[3].levers == {"SAT_PATCHES_COMPILE_LAYERS": "1"}
    planned = [proof_ladder.planned_seconds(config, s, memory_gb) for s in (routing, unchecked)]
    assert planned[1] <= planned[0]           # leaving layers out of checkpointing saves recomputation


def test_a_rungs_levers_are_set_while_it_runs_only(monkeypatch):
    monkeypatch.setenv("SAT_PATCHES_COMPILE_LAYERS", "0")
    monkeypatch.delenv("SAT_PATCHES_CHECKPOINT_SELECTIVE", raising=False)
    with proof_ladder.levers_set({"SAT_PATCHES_CHECKPOINT_SELECTIVE": "0.5"}):
        assert os.environ["SAT_PATCHES_CHECKPOINT_SELECTIVE"] == "0.5"
        assert "SAT_PATCHES_COMPILE_LAYERS" not in os.environ
    assert os.environ["SAT_PATCHES_COMPILE_LAYERS"] == "0" and "SAT_PATCHES_CHECKPOINT_SELECTIVE" not in os.environ


def test_the_table_sets_every_rung_beside_the_peer_and_the_plan():
    line = {"setting": "plan for 80 GB", "micro_batch": 4, "seconds": 0.5, "tokens_per_s": 10304.0, "peak": 7.1e10,
            "utilisation": 0.41, "first_loss": 11.0}
    text = proof_ladder.ladder_table([dict(line, rung="peer (HF + PEFT)", ratio=None, planned=None),
                                      dict(line, rung="selective", ratio=1.52, planned=0.48)])
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in text.splitlines()[2:]]
    assert rows[0][1] == "peer (HF + PEFT)" and rows[0][7:9] == ["", ""]
    assert rows[1][1:] == ["selective", "4", "0.500 s", "10,304", "71.00 GB", "41%", "1.52x", "0.480 s", "11.0000"]


@pytest.mark.slow
@pytest.mark.multirank
def test_the_ladder_runs_at_tiny_size_on_cpu(tmp_path):
    from kit_part import run_part
    data, output = run_part("l", tmp_path, "--hf-code", STANDIN)
    assert [r for r in data["rows"] if r["status"] != "ok"] == []
    table = data["ladder_table"]
    assert [line["rung"] for line in table] == ["peer (HF + PEFT)", *proof_ladder.RUNGS]
    assert all(line["tokens_per_s"] > 0 for line in table) and all(line["ratio"] > 0 for line in table[1:])
    ours = [line["first_loss"] for line in table[1:]]
    assert max(ours) - min(ours) < 1e-3, ours      # the same weights and batch: the levers change no value
    checks = " ".join(r["check"] for r in data["rows"])
    assert "selective 50% none 50%, eager" in checks and "full 50% none 50%, compiled" in checks
    assert "| plan for 80 GB | compiled | 2 |" in output
