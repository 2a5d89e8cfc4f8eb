"""The GPU kit's parts u and w (benchmarks/gpu/proof_fork.py): the user's own path, a CogVLM checkout's demo through
the drop-in script at MP=2 with two ranks sharing one card (``SAT_PATCHES_SHARED_GPU=1``).

* without a checkout each part says what it needs; part w says why it does not run without CUDA (fast);
* at tiny size on CPU (slow tier), against the synthetic checkout of the tests (upstream's layout, our code): two CPU
  ranks in the shared-GPU mode through the same script, the losses of the model-parallel ranks equal, every saved
  tensor in the run's dtype, a resume giving the uninterrupted run's later losses, ``sat-patches merge`` and
  ``export hf``, and transformers' ``LlamaForCausalLM`` on the export giving the merged model's text-only logits.
"""
import os

import pytest

from fake_checkout import write_fake_checkout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "benchmarks", "gpu")


@pytest.fixture
def kit(monkeypatch):
    """The kit's modules importable for one test (``sys.path`` put back afterwards)."""
    monkeypatch.syspath_prepend(KIT)
    import proof_fork
    import proof_record
    return proof_fork, proof_record


def test_without_a_checkout_the_parts_say_what_they_need(tmp_path, kit):
    proof_fork, proof_record = kit
    assert proof_fork.missing(None) == proof_fork.NEEDED
    (tmp_path / "utils" / "models").mkdir(parents=True)
    (tmp_path / "utils" / "models" / "__init__.py").write_text("")
    assert proof_fork.missing(str(tmp_path)).endswith("lacks finetune_demo/finetune_cogvlm_demo.py")
    for part in (proof_fork.run, proof_fork.whole):
        rec = proof_record.Recorder("u")
        part(rec, True, None, str(tmp_path))
        [row] = rec.rows
        assert row.status == f"skipped: {proof_fork.NEEDED}", row


def test_the_full_size_part_needs_cuda_and_a_card_holding_both_ranks(tmp_path, kit):
    proof_fork, proof_record = kit
    checkout = write_fake_checkout(str(tmp_path / "CogVLM"))
    rec = proof_record.Recorder("w")
    proof_fork.whole(rec, False, checkout, str(tmp_path))
    [row] = rec.rows
    assert row.status == "skipped: no CUDA", row
    # what it weighs on a card: each rank's planned share of the 17B model at MP=2 (about half of one 80 GB row)
    from sat_patches.planning.shapes import default_seq_len, plan_config
    config = proof_fork.model_config(full_depth=True)
    planned = proof_fork.planned_allocated(config, default_seq_len(plan_config(config)))
    assert 20e9 < planned < 70e9, planned
    assert proof_fork.model_config()["num_layers"] == proof_fork.LAYERS and config["num_layers"] == 32
    assert proof_fork.model_config()["hidden_size"] == config["hidden_size"] == 4096


@pytest.mark.parametrize("last_step", [2, 1])
def test_a_failure_after_the_last_step_has_its_own_row(tmp_path, kit, monkeypatch, last_step):
    """Part w's demo saves its merged model after its steps: a script that fails there leaves the steps' rows as
    the steps went; one that fails before its last step fails the steps' row."""
    proof_fork, proof_record = kit
    run = tmp_path / "checkpoints" / "run-1"

    def script_fails_after(cmd, cwd, env=None, what=""):
        run.mkdir(parents=True)
        (run / "latest").write_text(str(last_step))
        rows = "".join(f"{it},{10 + it},0.0\n" for it in range(1, last_step + 1))
        (run / "loss_curve.csv").write_text("iteration,loss,model_parallel_loss_spread\n" + rows)
        raise proof_fork.Failed(f"{what} exited with 247", "SAT_PATCHES_SHARED_GPU=1\nSaving Model...\n")

    monkeypatch.setattr(proof_fork, "call", script_fails_after)
    rec = proof_record.Recorder("w")
    with proof_fork.HostMemory() as memory:
        held = proof_fork.train(rec, "2 steps", str(tmp_path), str(tmp_path), False, then="the merged save",
                                extra={"TRAIN_ITERS": "2"})
    steps, after = rec.rows
    if last_step == 2:
        assert steps.status == "ok" and sorted(held["curve"]) == [1, 2], steps
        assert after.status == "FAIL" and "exited with 247" in after.detail, after
    else:
        assert steps.status == "FAIL" and "exited with 247" in steps.detail and held == {}, steps
        assert after.status.startswith("skipped: needs the run"), after
    assert 0 < memory.lowest_available < float("inf") and memory.highest_shared >= 0, str(memory)


def test_the_kit_knows_the_parts_and_passes_the_checkout_on(kit):
    import proof
    assert {"u", "w"} <= set(proof.PARTS)
    opts = proof.options(["--parts", "uw", "--checkout", "x"])
    assert opts.parts == "uw" and opts.checkout == "x"


@pytest.mark.slow
@pytest.mark.multirank
def test_the_users_path_runs_at_tiny_size_on_two_cpu_ranks_in_the_shared_gpu_mode(tmp_path):
    from kit_part import run_part
    checkout = write_fake_checkout(str(tmp_path / "CogVLM"))
    data, _ = run_part("u", tmp_path, "--checkout", checkout, timeout=900)
    rows = data["rows"]
    status = {r["check"]: r["status"] for r in rows}
    assert [c for c, s in status.items() if s != "ok"] == \
        [c for c in status if c.startswith("per-rank peak CUDA memory")], status
    assert status[next(c for c in status if c.startswith("per-rank peak"))] == "skipped: no CUDA"
    by_start = {r["check"].split(":")[0]: r for r in rows}
    assert by_start["the model-parallel ranks' losses are equal at every step"]["measured"].startswith(
        "largest spread 0 over 4 steps")
    assert "mp_rank_00_model_states.pt: torch.float32; mp_rank_01_model_states.pt: torch.float32" == \
        by_start["every saved tensor of each rank's shard in the run's dtype"]["measured"]


def test_prepare_carries_the_checkout_and_the_call_passes_it():
    """The checkout is the user's (a clone of the public repository), copied into the git-ignored wheels folder."""
    with open(os.path.join(KIT, "prepare.sh"), encoding="utf-8") as f:
        text = f.read()
    assert 'cp -r "$COGVLM_CHECKOUT/$d" "$DEST/cogvlm/"' in text and "for d in utils finetune_demo" in text
    assert "--checkout .gpu-wheels/cogvlm" in text
