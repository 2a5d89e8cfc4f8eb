"""SAT -> Hugging Face -> SAT is bit-identical: tiny CogVLM and CogAgent, from MP=1 and MP=2 saves, with
LoRA folded (equal to SAT's merge) and from an adapter-only save with its base."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from sat_patches.export.hf import export_hf
from sat_patches.export.importer import import_hf

from .helpers import (KINDS, assert_identical, base_state, build, config_of, folded, load_module, mp2_states, save,
                      save_adapter_only)


def hf_tensors(folder):
    """Every tensor of an HF folder, read with the safetensors library (not our reader)."""
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    out = {}
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(folder, file), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("kind", [k if k == "cogvlm" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_whole_checkpoint_mp1_and_mp2(kind, tmp_path):
    model, args = build(kind)
    state = model.state_dict()
    sat = save(str(tmp_path / "sat"), state, config_of(args))
    info = export_hf(sat, str(tmp_path / "hf"), max_shard_bytes=10**6)
    assert info["shards"] > 1                                    # several shards and their index
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    [back] = load_module(str(tmp_path / "back"))
    assert_identical(back, state)
    # what the finetune scripts do with MODEL_TYPE=<that folder>
    from sat_patches.cogvlm.models import model_class_for
    loaded, loaded_args = model_class_for(kind).from_pretrained(str(tmp_path / "back"), None)
    assert loaded_args.eva_args == args.eva_args and loaded_args.image_length == args.image_length
    assert_identical(loaded.state_dict(), state)

    # an MP=2 save (SAT's split rules) exports to the same HF tensors, and imports back to the same shards
    mp2 = mp2_states(model, state)
    sat2 = save(str(tmp_path / "sat2"), None, config_of(args), mp2)
    export_hf(sat2, str(tmp_path / "hf2"))
    want = hf_tensors(str(tmp_path / "hf"))
    assert_identical(hf_tensors(str(tmp_path / "hf2")), want)
    import_hf(str(tmp_path / "hf2"), str(tmp_path / "back2"), mp=2)
    for got, saved in zip(load_module(str(tmp_path / "back2")), (mp2[0], mp2[1])):
        assert_identical(got, saved)
    config = json.load(open(tmp_path / "back2" / "model_config.json"))
    assert config["model_parallel_size"] == 2 and config["model_class"] == args.model_class.replace("FineTuneTrain", "")


@pytest.mark.parametrize("kind", [k if k == "cogvlm" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_lora_folded_equals_sats_merge_mp1_mp2_and_adapter_only(kind, tmp_path):
    model, args = build(kind, lora_rank=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = config_of(args)
    mp2 = mp2_states(model, state)
    merged = folded(model)
    assert any(not torch.equal(merged[k], base_state(state)[k]) for k in merged)   # the LoRA changes weights

    sat = save(str(tmp_path / "lora"), state, config)
    info = export_hf(sat, str(tmp_path / "hf"))
    assert info["lora_layers"] == (10 if kind == "cogagent" else 4)   # qkv, dense (+ cross query, key_value, dense)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert_identical(load_module(str(tmp_path / "back"))[0], merged)

    save(str(tmp_path / "lora2"), None, config, mp2)
    export_hf(str(tmp_path / "lora2"), str(tmp_path / "hf2"))
    assert_identical(hf_tensors(str(tmp_path / "hf2")), hf_tensors(str(tmp_path / "hf")))

    base = save(str(tmp_path / "base"), base_state(state), config)
    adapter = save_adapter_only(str(tmp_path / "adapter"), state, config, base)
    info = export_hf(adapter, str(tmp_path / "hf3"))
    assert info["adapter_only"]
    import_hf(str(tmp_path / "hf3"), str(tmp_path / "back3"))
    assert_identical(load_module(str(tmp_path / "back3"))[0], merged)


def test_exported_folder_layout_and_config(tmp_path):
    model, args = build("cogagent")
    sat = save(str(tmp_path / "sat"), model.state_dict(), dict(config_of(args), layernorm_epsilon=1e-6))
    code = tmp_path / "hub"
    code.mkdir()
    for f in ("modeling_cogagent.py", "configuration_cogagent.py", "visual.py", "cross_visual.py"):
        (code / f).write_text("# the user's copy\n")
    export_hf(sat, str(tmp_path / "hf"), hf_code=str(code))
    listing = sorted(os.listdir(tmp_path / "hf"))
    assert listing == ["config.json", "configuration_cogagent.py", "cross_visual.py", "generation_config.json",
                       "model-00001-of-00001.safetensors", "model.safetensors.index.json", "modeling_cogagent.py",
                       "visual.py"]
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["architectures"] == ["CogAgentForCausalLM"]
    assert config["auto_map"] == {"AutoConfig": "configuration_cogagent.CogAgentConfig",   # the copied files
                                  "AutoModelForCausalLM": "modeling_cogagent.CogAgentForCausalLM"}
    assert config["rms_norm_eps"] == 1e-6 and config["torch_dtype"] == "float32"
    assert config["template_version"] == "chat" and config["cross_image_size"] == 112
    assert config["cross_compute_hidden_size"] == 4 * 16 and config["cross_hidden_size"] == 64
    assert config["vision_config"]["num_positions"] == 17 and config["vision_config"]["image_size"] == 56
    assert sorted(os.listdir(tmp_path)) == ["hf", "hub", "sat"]      # nothing staged left beside OUT


@pytest.mark.parametrize("kind, repo, module, cls", [
    ("cogvlm", "THUDM/cogvlm-chat-hf", "cogvlm", "CogVLM"), ("cogagent", "THUDM/cogagent-chat-hf", "cogagent", "CogAgent")])
def test_without_hf_code_auto_map_names_the_released_repository(kind, repo, module, cls, tmp_path):
    """No ``.py`` files in the folder: ``auto_map`` takes the code from the released hub repository."""
    model, args = build(kind)
    sat = save(str(tmp_path / "sat"), model.state_dict(), config_of(args))
    export_hf(sat, str(tmp_path / "hf"))
    assert not [f for f in os.listdir(tmp_path / "hf") if f.endswith(".py")]
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["auto_map"] == {"AutoConfig": f"{repo}--configuration_{module}.{cls}Config",
                                  "AutoModelForCausalLM": f"{repo}--modeling_{module}.{cls}ForCausalLM"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_round_trip(dtype, tmp_path):
    """bf16/fp16 (how released and trained checkpoints are saved): the safetensors library reads our shards
    with the same bits, and they import back unchanged."""
    model, args = build("cogvlm")
    state = {k: v.to(dtype) if v.is_floating_point() and "inv_freq" not in k else v
             for k, v in model.state_dict().items()}
    sat = save(str(tmp_path / "sat"), state, config_of(args))
    export_hf(sat, str(tmp_path / "hf"))
    from sat_patches.export import names
    exported = hf_tensors(str(tmp_path / "hf"))
    for name, t in exported.items():
        assert torch.equal(t, state[names.sat_name(name)]) and t.dtype == state[names.sat_name(name)].dtype, name
    assert json.load(open(tmp_path / "hf" / "config.json"))["torch_dtype"] == str(dtype).replace("torch.", "")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert_identical(load_module(str(tmp_path / "back"))[0], state)
