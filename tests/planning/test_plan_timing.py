"""The plan's time model against steps measured on a GPU, and the choice it makes: the fastest setting that fits."""
import pytest

from sat_patches.planning import memory, realise, search, shapes
from sat_patches.planning import timing

# One H200, full-size CogVLM (cogvlm-base-490), LoRA rank 10 on the language model and EVA, 1288 tokens per
# sample, random bf16 weights, forward + loss + backward + AdamW, expert routing by image block (micro-batch 1:
# boolean-mask routing). (micro-batch, language layers left out of checkpointing or None: no checkpointing,
# seconds per step, peak GB)
H200_STEPS = [
    (8, 0, 1.69, 45.6),
    (8, 8, 1.55, 67.4),
    (8, 16, 1.47, 89.7),
    (8, 24, 1.30, 112.0),
    (8, None, 1.17, 134.2),
    (1, None, 0.431, None),
]
CONFIG = shapes.MODELS["cogvlm-base-490"]


def _setup(micro_batch, skip, **fields):
    return memory.Setup(micro_batch=micro_batch, seq_len=1288, checkpoint_activations=skip is not None,
                      checkpoint_skip_layers=skip or 0, **fields)


@pytest.mark.parametrize("micro_batch, skip, seconds, peak_gb", H200_STEPS)
def test_predicted_step_is_within_10_percent_of_the_h200_measurement(micro_batch, skip, seconds, peak_gb):
    predicted = timing.step_time(CONFIG, _setup(micro_batch, skip), timing.CARDS["h200"].tflops).seconds
    assert abs(predicted / seconds - 1) < 0.10, (predicted, seconds)


def test_useful_work_is_twice_the_forward_pass_of_about_3e13_flop_per_sample():
    """The forward pass of one 1288-token sample is 2.9e13 FLOP (the language model, EVA, adapter and head);
    forward plus the input-gradient backward twice that: 6e13 per sample is 252 TFLOP/s at 8 samples in the
    1.913 s step of mask routing, the utilisation quoted for it."""
    one = timing.step_time(CONFIG, _setup(1, None), 989)
    assert 2.8e13 < one.useful_flop / 2 < 3.1e13
    assert 240e12 < 8 * one.useful_flop / 1.913 < 255e12


def test_recomputation_is_the_forward_of_the_checkpointed_layers():
    every, quarter, none = (timing.step_time(CONFIG, _setup(8, skip), 989) for skip in (0, 8, None))
    assert none.recomputed_flop == 0 and every.useful_flop == none.useful_flop
    assert quarter.recomputed_flop == pytest.approx(0.75 * every.recomputed_flop, rel=0.02)
    assert every.seconds > quarter.seconds > none.seconds


def test_memory_grows_with_the_layers_left_out_of_checkpointing_as_measured():
    """About 22 GB per quarter of the layers at micro-batch 8 (language and the same share of EVA's), and the
    plan at or above each measured peak (it adds its terms' peaks)."""
    measured = [(skip, gb) for mb, skip, _, gb in H200_STEPS if gb is not None]
    planned = [memory.estimate(CONFIG, _setup(8, skip)).per_gpu / memory.GB for skip, _ in measured]
    for (_, gb), p in zip(measured, planned):
        assert gb <= p <= gb * 1.10, (gb, p)
    for i in range(1, len(measured)):
        step_measured, step_planned = measured[i][1] - measured[i - 1][1], planned[i] - planned[i - 1]
        assert abs(step_planned / step_measured - 1) < 0.15, (i, step_planned, step_measured)


def test_eva_leaves_the_same_share_of_its_layers_out():
    assert timing.eva_skip_layers(8, 32, 63) == 15
    assert timing.eva_skip_layers(31, 32, 63) == 61
    assert timing.checkpointed_layers(CONFIG, _setup(8, 16)) == (16, 32)
    assert timing.checkpointed_layers(CONFIG, _setup(8, None)) == (0, 0)


def test_a_card_is_named_given_in_tflops_or_assumed_from_its_memory():
    assert timing.card("H200")[0].tflops == 989
    assert timing.card(tflops=500)[0].tflops == 500
    assert timing.card(memory_gb=80) == (timing.CARDS["h100"], "assumed from 80 GB")
    assert timing.card(memory_gb=141)[0].name == "h200"
    with pytest.raises(ValueError, match="unknown GPU"):
        timing.card("tpu")


def _recommend(gb, **kw):
    """One GPU, a global batch of 8: micro-batch 8 without accumulation is among the splits."""
    return search.recommend(search.options(CONFIG, 1, gb, seq_len=1288, global_batch=8, **kw))


@pytest.mark.parametrize("gb", [24, 48, 80, 141])
def test_the_chosen_row_fits_within_its_own_memory_estimate(gb):
    best = _recommend(gb)
    assert best.viable and best.estimate.per_gpu <= gb * memory.GB * (1 - search.GPU_MARGIN)
    again = memory.estimate(CONFIG, best.estimate.setup)
    assert again.per_gpu == best.estimate.per_gpu


@pytest.mark.parametrize("gb", [80, 141])
def test_spare_memory_is_spent_on_speed(gb):
    """Not 'the largest micro-batch, every layer checkpointed': layers left out of checkpointing where memory
    allows, and faster than that setting by the model's own prediction."""
    best = _recommend(gb)
    s = best.estimate.setup
    assert s.micro_batch == 8 and (s.checkpoint_skip_layers > 0 or not s.checkpoint_activations)
    every = [o for o in search.options(CONFIG, 1, gb, seq_len=1288, micro_batch=8, checkpoint_skip_layers=0,
                                     zero=s.zero, offload=s.offload, qlora=False, global_batch=8)]
    assert best.time.tokens_per_s > 1.1 * every[0].time.tokens_per_s
    assert best.estimate.per_gpu > every[0].estimate.per_gpu + 15 * memory.GB


def test_more_memory_buys_more_speed():
    chosen = [_recommend(gb) for gb in (80, 141)]
    assert chosen[1].time.tokens_per_s > chosen[0].time.tokens_per_s
    assert chosen[1].estimate.setup.checkpoint_skip_layers > chosen[0].estimate.setup.checkpoint_skip_layers


def test_a_given_skip_or_no_checkpointing_is_the_only_one_planned():
    assert {o.estimate.setup.checkpoint_skip_layers for o in search.options(CONFIG, 1, 80, checkpoint_skip_layers=4)} == {4}
    assert not any(o.estimate.setup.checkpoint_activations
                   for o in search.options(CONFIG, 1, 80, checkpoint_activations=False))


def test_checkpoint_options_and_script_settings_carry_the_skip():
    s = _setup(8, 10)
    assert realise.checkpoint_options(s) == ["--checkpoint-activations", "--vit_checkpoint_activations",
                                          "--checkpoint-skip-layers", "10"]
    assert realise.script_settings(s)["CHECKPOINT_SKIP_LAYERS"] == "10"
    assert realise.checkpoint_options(_setup(8, None)) == []
    assert realise.script_settings(_setup(8, None))["CHECKPOINT_ACTIVATIONS"] == "0"


@pytest.mark.parametrize("gb, card", [(80, "h100"), (141, "h200")])
def test_cli_prints_step_time_and_tokens_per_s_per_row_and_spends_spare_memory(capsys, gb, card):
    from sat_patches.cli.main import main
    assert main(["plan", "--model", "cogvlm-base-490", "--gpus", "1", "--gpu-mem", str(gb), "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert f"card: {card}, 989 TFLOP/s bf16 (assumed from {gb} GB" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("MP"))
    assert header.split()[-3:] == ["step", "s", "tokens/s"]
    rows = [line.split() for line in out.splitlines() if line.endswith("  ok")]
    assert rows and all(float(r[-3]) > 0 and int(r[-2]) > 1000 for r in rows)
    best = _recommend(gb).estimate.setup
    layers = CONFIG["num_layers"]
    share = round(100 * best.checkpoint_skip_layers / layers)
    assert f"checkpointing full {100 - share}% none {share}%, eager layers:" in out
    assert f"--checkpoint-skip-layers {best.checkpoint_skip_layers}" in out
    assert "tokens/s predicted" in out


def test_cli_json_has_the_predicted_step_and_takes_a_card_by_name_or_tflops(capsys):
    import json
    from sat_patches.cli.main import main
    args = ["plan", "--model", "cogvlm-base-490", "--gpus", "1", "--gpu-mem", "80", "--json"]
    assert main(args + ["--gpu", "a100"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["card"] == {"name": "a100", "tflops": 312, "chosen": "given"}
    assert all(o["step_seconds"] > 0 and o["tokens_per_s"] > 0 for o in slow["options"])
    assert main(args + ["--tflops", "989"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["recommended"]["tokens_per_s"] > 2 * slow["recommended"]["tokens_per_s"]
    with pytest.raises(SystemExit, match="unknown GPU"):
        main(args + ["--gpu", "tpu"])
