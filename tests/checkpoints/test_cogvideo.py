"""A CogVideoX run's LoRA merged into its DiT and exported in diffusers' layout, from synthetic model-parallel
shards laid out as SAT saves CogVideoX's engine (``model.diffusion_model.transformer.layers.N...``) beside the
run's ``training_config.yaml``: any layer count (2B's 30, 5B's 42), shards joined, the scale ``lora_alpha / r``
carried; diffusers itself loads and fuses the export to SAT's folded update."""
import json
import os
import struct

import pytest
import torch
import yaml

from sat_patches.checkpoints import cogvideo, writer
from sat_patches.checkpoints.files import CheckpointError

DIT = "model.diffusion_model.transformer.layers"


def full_run(layers, hidden, r, seed=0):
    """A whole save's tensors at MP=1: each layer's qkv and dense (LoRA-wrapped, ``original``) with factors, a
    replicated norm, T5's and the VAE's weights."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g) * 0.1
    state = {"conditioner.embedders.0.weight": draw(4, 4), "first_stage_model.decoder.weight": draw(4, 4)}
    for i in range(layers):
        layer = f"{DIT}.{i}.attention"
        state[f"{DIT}.{i}.input_layernorm.weight"] = draw(hidden)
        state[f"{layer}.query_key_value.original.weight"] = draw(3 * hidden, hidden)
        state[f"{layer}.query_key_value.original.bias"] = draw(3 * hidden)
        state[f"{layer}.dense.original.weight"] = draw(hidden, hidden)
        for j in range(3):
            state[f"{layer}.query_key_value.matrix_A.{j}"] = draw(r, hidden)
            state[f"{layer}.query_key_value.matrix_B.{j}"] = draw(hidden, r)
        state[f"{layer}.dense.matrix_A.0"] = draw(r, hidden)
        state[f"{layer}.dense.matrix_B.0"] = draw(hidden, r)
    return state


def split_mp2(state):
    """The two shards SAT's model-parallel layers hold at MP=2 (qkv: Q, K, V rows each halved; dense: columns)."""
    shards = ({}, {})
    for key, t in state.items():
        if ".query_key_value.original." in key or ".query_key_value.matrix_B." in key:
            blocks = t.chunk(3) if ".original." in key else (t,)
            halves = [b.chunk(2) for b in blocks]
            parts = [torch.cat([h[k] for h in halves]) for k in range(2)]
        elif key.endswith(".dense.original.weight") or ".dense.matrix_A." in key:
            parts = t.chunk(2, dim=1)
        else:
            parts = (t, t)
        for shard, part in zip(shards, parts):
            shard[key] = part.clone()
    return shards


def write_run(path, state, lora_alpha=None, mp=2, adapter_only=False):
    saved = {k: v for k, v in state.items() if not adapter_only or ".matrix_" in k}
    shards = split_mp2(saved) if mp == 2 else (saved,)
    writer.write_layout(path, 10, {i: {"module": s} for i, s in enumerate(shards)})
    lora = {"target": "sat.model.finetune.lora2.LoraMixin", "params": {"r": 4}}
    if lora_alpha is not None:
        lora["params"]["lora_alpha"] = lora_alpha
    with open(os.path.join(path, "training_config.yaml"), "w") as f:
        yaml.safe_dump({"model": {"network_config": {"params": {"modules": {"lora_config": lora}}}}}, f)


def folded(state, layer, alpha):
    """SAT's update of one layer: lora2 adds ``alpha / r * B_i @ A_i`` to its i-th block of rows."""
    count = 3 if layer.endswith("query_key_value") else 1
    blocks = [state[f"{layer}.matrix_B.{j}"] @ state[f"{layer}.matrix_A.{j}"] for j in range(count)]
    return torch.cat(blocks) * alpha / state[f"{layer}.matrix_A.0"].shape[0]


def safetensors_keys(path):
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return set(json.loads(f.read(size))) - {"__metadata__"}


@pytest.mark.parametrize("layers", [30, 42])
def test_export_names_every_layer_from_joined_shards(tmp_path, layers):
    write_run(str(tmp_path / "run"), full_run(layers, hidden=8, r=2), lora_alpha=8, adapter_only=True)
    info = cogvideo.export_diffusers(str(tmp_path / "run"), str(tmp_path / "out"))
    names = [f"transformer.transformer_blocks.{i}.attn1.{t}.lora_{f}.weight" for i in range(layers)
             for t in ("to_q", "to_k", "to_v", "to_out.0") for f in "AB"]
    assert safetensors_keys(str(tmp_path / "out" / cogvideo.DIFFUSERS_FILE)) == set(names)
    assert info == {"tensors": 8 * layers, "layers": 2 * layers, "shards": 2, "alpha": 8.0}


def test_merge_joins_shards_folds_the_lora_and_leaves_t5_and_the_vae_out(tmp_path):
    state = full_run(2, hidden=8, r=2)
    write_run(str(tmp_path / "run"), state, lora_alpha=4)
    cogvideo.merge(str(tmp_path / "run"), str(tmp_path / "merged"))
    [shard] = cogvideo.files.find_checkpoint(str(tmp_path / "merged")).files
    merged = torch.load(shard, weights_only=True)["module"]
    expected = {k.replace(".original.", "."): v for k, v in state.items()
                if ".matrix_" not in k and not k.startswith(("conditioner.", "first_stage_model."))}
    assert set(merged) == set(expected)
    for i in range(2):
        for name in ("query_key_value", "dense"):
            layer = f"{DIT}.{i}.attention.{name}"
            expected[f"{layer}.weight"] = expected[f"{layer}.weight"] + folded(state, layer, 4)
    worst = max(float((merged[k] - expected[k]).abs().max()) for k in expected)
    assert worst < 1e-6, worst


def test_a_run_without_its_config_or_a_lora_off_attention_is_refused(tmp_path):
    state = full_run(1, hidden=8, r=2)
    writer.write_layout(str(tmp_path / "bare"), 1, {0: {"module": state}})
    with pytest.raises(CheckpointError, match="has no training_config.yaml .* pass --lora-alpha"):
        cogvideo.export_diffusers(str(tmp_path / "bare"), str(tmp_path / "out"))
    state[f"{DIT}.0.mlp.dense_h_to_4h.matrix_A.0"] = torch.zeros(2, 8)
    state[f"{DIT}.0.mlp.dense_h_to_4h.matrix_B.0"] = torch.zeros(32, 2)
    write_run(str(tmp_path / "mlp"), state, mp=1)
    with pytest.raises(CheckpointError, match="LoRA on '.*mlp.dense_h_to_4h'.* query_key_value .* and dense only"):
        cogvideo.export_diffusers(str(tmp_path / "mlp"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_diffusers_loads_the_export_and_fuses_it_to_sats_update(tmp_path):
    """A tiny CogVideoXTransformer3DModel (2 layers, 2 heads of 8): ``load_lora_weights`` of the export, then
    ``fuse_lora``; each of Q, K, V and the output projection changes by SAT's folded update (fp32)."""
    import diffusers
    state = full_run(2, hidden=16, r=4, seed=1)
    write_run(str(tmp_path / "run"), state, lora_alpha=2)  # scale 2 / 4: diffusers must not be left at 1
    cogvideo.export_diffusers(str(tmp_path / "run"), str(tmp_path / "lora"))
    transformer = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2, text_embed_dim=16,
        time_embed_dim=8, sample_width=8, sample_height=8, sample_frames=9, patch_size=2)
    pipe = diffusers.CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                                       scheduler=None)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    pipe.load_lora_weights(str(tmp_path / "lora"), weight_name=cogvideo.DIFFUSERS_FILE)  # offline, older diffusers
    pipe.fuse_lora(components=["transformer"])  # diffusers 0.31 defaults to the text encoder too
    after = transformer.state_dict()
    worst = 0.0
    for i in range(2):
        qkv = folded(state, f"{DIT}.{i}.attention.query_key_value", 2).chunk(3)
        out = folded(state, f"{DIT}.{i}.attention.dense", 2)
        for target, delta in zip(("to_q", "to_k", "to_v", "to_out.0"), (*qkv, out)):
            name = f"transformer_blocks.{i}.attn1.{target}"
            fused = after.get(f"{name}.base_layer.weight", after.get(f"{name}.weight"))
            worst = max(worst, float((fused - before[f"{name}.weight"] - delta).abs().max()))
            assert float(delta.abs().max()) > 1e-3
    assert worst < 1e-6, worst


def test_the_command_lines_take_a_run_folder(tmp_path, capsys):
    from sat_patches.cli import export as export_cli, merge as merge_cli
    write_run(str(tmp_path / "run"), full_run(2, hidden=8, r=2), adapter_only=False)  # no lora_alpha: LoraMixin's 1
    assert merge_cli.main([str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    assert export_cli.main(["diffusers", str(tmp_path / "run"), str(tmp_path / "lora"), "--lora-alpha", "4"]) == 0
    out = capsys.readouterr().out
    assert "merged 2 model-parallel shard(s) of iteration 10 and 4 LoRA layer(s)" in out
    assert "16 tensors, from 2 model-parallel shard(s), lora_alpha 4 / r folded into lora_B" in out
    assert export_cli.main(["diffusers", str(tmp_path / "run"), str(tmp_path / "lora")]) == 1
    assert "exists; choose a new output folder or pass --overwrite" in capsys.readouterr().err
