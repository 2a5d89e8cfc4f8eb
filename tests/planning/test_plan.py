"""``sat-patches plan``: component sizes against upstream's numbers, and the published requirements."""
import json
import os

import pytest

from sat_patches.planning import memory, realise, search, shapes

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def _fixture_parameters(name):
    """Parameters of the hand-written upstream state-dict description in tests/fixtures (buffers left out)."""
    d = json.load(open(os.path.join(FIXTURES, f"{name}.keys.json")))
    cfg = d["model_config"]
    env = {k: v for k, v in cfg.items() if not isinstance(v, (dict, list))}
    env.update({"eva_" + k: v for k, v in cfg["eva_args"].items() if not isinstance(v, (dict, list))})
    env.update({"enc_" + k: v for k, v in {**(d.get("encoder_defaults") or {}), **(cfg.get("encoder_args") or {})}.items()})
    env.update(min=min, int=int)
    total = 0
    for key, shape in d["keys"].items():
        if key in d["buffers"]:
            continue
        count = 1
        for expr in shape:
            count *= eval(expr, env)
        prefix = key.split(".N.")[0] if ".N." in key else None
        total += count * (eval(d["layer_counts"][prefix], env) if prefix else 1)
    return total


def test_cogvlm_count_is_the_17657466368_sat_prints_in_cogvlm_issue_117():
    # FineTuneTestCogVLMModel with upstream's LoRA (rank 10, language model and EVA), 224 px
    assert shapes.parameter_count(shapes.MODELS["cogvlm-base-224"], lora_rank=10, lora_eva=True) == 17_657_466_368


@pytest.mark.parametrize("name", ["cogvlm-base-490", "cogagent-chat"])
def test_component_sizes_match_the_upstream_state_dict_description(name):
    assert shapes.parameter_count(shapes.MODELS[name]) == _fixture_parameters(name)


def test_model_table_agrees_with_the_cogvlm_package_configs():
    from sat_patches.cogvlm.config import UPSTREAM_CONFIGS
    for name, theirs in UPSTREAM_CONFIGS.items():
        ours = shapes.MODELS[name]
        for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "inner_hidden_size",
                    "image_length", "cross_attn_hidden_size", "cross_hidden_size_per_attention_head", "cross_image_pix"):
            assert ours.get(key) == theirs.get(key), (name, key)
        for key in ("num_layers", "hidden_size", "num_attention_heads", "inner_hidden_size", "max_sequence_length",
                    "patch_size"):
            assert ours["eva_args"][key] == theirs["eva_args"][key], (name, key)


def _best(name, gpus, gb, **kw):
    config = shapes.MODELS[name]
    return search.recommend(search.options(config, gpus, gb, host_mem_gb=kw.pop("host", None),
                                       seq_len=shapes.default_seq_len(config), **kw))


def test_upstream_requirement_cogvlm_finetuning_4xA100_80G_or_8xRTX3090_24G():
    """README: fine-tuning needs 4 x A100 (80G) or 8 x RTX 3090 (24G); on 3090s use model parallel.
    Upstream's demo trains LoRA plus EVA MLPs (--train demo)."""
    a100 = _best("cogvlm-base-490", 4, 80, train="demo")
    assert a100 is not None and a100.estimate.setup.mp == 1
    rtx = _best("cogvlm-base-224", 8, 24, train="demo")
    assert rtx is not None and rtx.estimate.setup.mp >= 2          # weights alone are 35 GB at MP=1
    assert _best("cogvlm-base-490", 1, 24, train="demo") is None
    assert memory.estimate(shapes.MODELS["cogvlm-base-490"], memory.Setup(gpus=8, mp=1)).device["weights"] > 24e9


def test_upstream_requirement_cogagent_lora_about_8x24GB():
    best = _best("cogagent-chat", 8, 24)
    assert best is not None and best.estimate.setup.mp >= 2 and best.estimate.per_gpu <= 24e9
    assert _best("cogagent-chat", 1, 24, qlora=False) is None  # with a bf16 base


@pytest.mark.parametrize("name", ["cogvlm-base-490", "cogagent-chat"])
def test_one_24GB_gpu_gets_qlora_and_its_settings(name):
    from sat_patches.cli.main import main
    best = _best(name, 1, 24, host=32)
    assert best.estimate.setup.qlora and best.estimate.setup.mp == 1 and best.estimate.per_gpu <= 24e9
    assert realise.script_settings(best.estimate.setup)["QLORA"] == "1"
    assert "weights (NF4)" in best.estimate.device
    assert main(["plan", "--model", name, "--gpus", "1", "--gpu-mem", "24", "--host-mem", "32"]) == 0


def test_qlora_only_at_mp1_and_never_for_the_demo_set():
    opts = search.options(shapes.MODELS["cogvlm-base-490"], 4, 80, seq_len=1288)
    assert {o.estimate.setup.mp for o in opts if o.estimate.setup.qlora} == {1}
    assert not any(o.estimate.setup.qlora for o in search.options(shapes.MODELS["cogvlm-base-490"], 4, 80, seq_len=1288,
                                                                 train="demo"))
    assert not _best("cogvlm-base-490", 4, 80).estimate.setup.qlora  # a bf16 base where one fits


def test_stock_sat_host_memory_matches_the_kill_9_reports():
    """CogVLM 320: 2 x 4090 with 64 GB of RAM fills up; 283: 8 x V100 killed while building."""
    e = memory.estimate(shapes.MODELS["cogvlm-chat-v1.1"], memory.Setup(gpus=2, mp=2))
    assert e.host_stock_node > 64e9 > e.host_node
    e8 = memory.estimate(shapes.MODELS["cogvlm-chat-v1.1"], memory.Setup(gpus=8, mp=1))
    assert e8.host_stock_node > 8 * 60e9


def test_offload_moves_optimizer_states_to_the_host_and_only_under_zero():
    config = shapes.MODELS["cogagent-chat"]
    on = memory.estimate(config, memory.Setup(gpus=8, mp=4, zero=2, offload=True, train="demo"))
    off = memory.estimate(config, memory.Setup(gpus=8, mp=4, zero=2, offload=False, train="demo"))
    assert off.per_gpu - on.per_gpu == pytest.approx(on.host["optimizer states (offloaded)"])
    assert not any(o.estimate.setup.offload and o.estimate.setup.zero == 0
                   for o in search.options(config, 8, 24, seq_len=400))


def test_mp_sizes_divide_gpus_and_every_head_count():
    assert search.model_parallel_sizes(shapes.MODELS["cogvlm-base-490"], 8) == [1, 2, 4, 8]
    assert search.model_parallel_sizes(shapes.MODELS["cogvlm-base-490"], 6) == [1, 2]


def test_recommended_deepspeed_config_puts_offload_where_deepspeed_reads_it():
    from sat_patches.runtime.deepspeed_config import lint_deepspeed_config
    s = memory.Setup(gpus=8, mp=2, zero=2, offload=True, micro_batch=2)
    config = realise.deepspeed_config(s)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert lint_deepspeed_config(json.loads(json.dumps(config)), world_size=8, model_parallel_size=2) == config
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (8, 1)  # 2 x 1 x 4 data-parallel
    assert realise.script_settings(s) == {"NUM_GPUS_PER_WORKER": "8", "MP_SIZE": "2", "LOCAL_WORLD_SIZE": "8",
                                          "GLOBAL_BATCH": "8"}  # not upstream's 4 per data-parallel rank
    assert "GLOBAL_BATCH" not in realise.script_settings(memory.Setup(gpus=8, mp=2, micro_batch=2, accumulation=2))


def test_cli_plan_prints_a_table_recommendation_and_settings(capsys):
    from sat_patches.cli.main import main
    assert main(["plan", "--model", "cogvlm-base-490", "--gpus", "8", "--gpu-mem", "24", "--host-mem", "256"]) == 0
    out = capsys.readouterr().out
    assert "17.64 B parameters" in out and "recommended: MP_SIZE=2" in out
    assert "NUM_GPUS_PER_WORKER=8 MP_SIZE=2" in out and '"zero_optimization"' in out
    assert len(out.splitlines()) <= 30  # one screen
    assert main(["plan", "--model", "cogagent-vqa", "--gpus", "1", "--gpu-mem", "12"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    assert main(["plan", "--model", "cogvlm-grounding-generalist", "--gpus", "4", "--gpu-mem", "80", "--zero", "2",
                 "--offload", "none", "--micro-batch", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    chosen = {(o["setup"]["zero"], o["setup"]["offload"], o["setup"]["micro_batch"]) for o in data["options"]}
    assert chosen == {(2, False, 2)}
    assert data["recommended"]["script"]["MP_SIZE"] == "1"


def test_plan_reads_a_checkpoint_model_config(tmp_path):
    published = {k: v for k, v in shapes.MODELS["cogvlm-base-490"].items() if k != "num_vision_layers"}
    (tmp_path / "model_config.json").write_text(json.dumps(published))
    config = shapes.resolve_model(str(tmp_path))
    assert shapes.parameter_count(config) == shapes.parameter_count(shapes.MODELS["cogvlm-base-490"])
    with pytest.raises(SystemExit, match="unknown model"):
        shapes.resolve_model("cogvlm-huge")


def test_the_plan_keeps_the_global_batch_and_chooses_only_its_split(capsys):
    """Upstream's 4 samples per data-parallel rank by default; --global-batch N for every row; an MP size whose
    data-parallel ranks cannot share it has no row."""
    from sat_patches.cli.main import main
    from sat_patches.planning import timing
    config = shapes.MODELS["cogvlm-base-490"]
    opts = search.options(config, 2, 24, seq_len=1288, global_batch=4)
    assert opts and {o.estimate.setup.global_batch for o in opts} == {4}
    splits = {(s.mp, s.micro_batch, s.accumulation) for s in (o.estimate.setup for o in opts)}
    assert splits == {(2, 1, 4), (2, 2, 2), (2, 4, 1), (1, 1, 2), (1, 2, 1)}  # MP 1: 2 data-parallel ranks
    assert {o.estimate.setup.global_batch for o in search.options(config, 2, 80, seq_len=1288)} == {4, 8}  # MP 2, 1
    assert {o.estimate.setup.mp for o in search.options(config, 2, 80, seq_len=1288, global_batch=3)} == {2}
    one, two = (timing.step_time(config, memory.Setup(micro_batch=2, accumulation=a), 989) for a in (1, 2))
    assert two.seconds == pytest.approx(2 * one.seconds) and two.tokens_per_s == pytest.approx(one.tokens_per_s)
    assert main(["plan", "--model", "cogvlm-base-490", "--gpus", "2", "--gpu-mem", "24", "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch  accumulation  global batch" in out
    assert "global batch 4 = micro-batch 2 x accumulation 2 x 1 data-parallel ranks" in out
