"""Tiny CogVLM/CogAgent checkpoints for the export tests: whole, with unmerged LoRA, adapter-only, MP=2."""
import os

import torch

from sat_patches.checkpoints import adapter, files, safe_load, writer
from sat_patches.checkpoints.lora_names import is_adapter

KINDS = ("cogvlm", "cogagent")


def build(kind, lora_rank=0, seed=0, **overrides):
    """The tiny model (fp32); with ``lora_rank``, SAT lora2 on every language layer, B != 0."""
    from sat_patches.cogvlm.tiny import build_tiny_model
    torch.manual_seed(seed)
    model, args = build_tiny_model(kind, **overrides)
    if lora_rank:
        from sat.model.finetune.lora2 import LoraMixin
        model.add_mixin("lora", LoraMixin(args.num_layers, lora_rank, layer_range=None,
                                          cross_attention=kind == "cogagent"), reinit=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "matrix_B" in name:
                    p.normal_(0, 0.05)
    return model.eval(), args


def config_of(args):
    from sat_patches.cogvlm.config import model_config_dict
    return model_config_dict(args)


def save(directory, state, config, mp_states=None):
    """A SAT checkpoint of ``state`` (iteration 1); ``mp_states``: {rank: state} of several shards instead."""
    shards = mp_states or {0: state}
    config = dict(config, model_parallel_size=len(shards))
    writer.write_layout(directory, 1, {r: {"module": s, "iteration": 1} for r, s in shards.items()}, config)
    return directory


def save_adapter_only(directory, state, config, base_dir):
    """An adapter-only save (LoRA matrices only, adapter.json naming ``base_dir``), as a LoRA run writes it."""
    save(directory, {k: v for k, v in state.items() if is_adapter(k)}, config)
    adapter.write_manifest(os.path.join(directory, "1"), adapter.fingerprint(files.find_checkpoint(base_dir)))
    return directory


def base_state(state):
    """A LoRA model's base weights under plain names (the checkpoint it was started from)."""
    return {k.replace(".original.", "."): v for k, v in state.items() if not is_adapter(k)}


def folded(model):
    """SAT's merge of every LoRA layer of ``model`` (the patched ``merge_linear_lora``: what
    ``python -m sat_patches merge`` writes), as a state dict."""
    from sat_patches.checkpoints.merge import fold_lora
    from sat_patches.lora.layer import is_lora_layer
    fold_lora(model, [n for n, m in model.named_modules() if is_lora_layer(m)])
    return model.state_dict()


def mp2_states(model, state):
    """``state`` split over 2 model-parallel ranks by SAT's layer types (Column by stride, Row by input,
    vocabulary rows; LoRA by its layer), for checkpoints as an MP=2 run saves them."""
    from sat_patches.checkpoints import sharding
    from sat_patches.export.importer import rank_piece
    out = {0: {}, 1: {}}
    for key, t in state.items():
        path, _, name = key.rpartition(".")
        if ".matrix_" in key:
            layer_path, _, rest = key.rpartition(".matrix_")
            kind = sharding.parallel_kind(model.get_submodule(layer_path).original)
            split = sharding.lora_factor_split(kind, "matrix_" + rest[0])
        else:
            split = sharding.split_of(model, key, model.get_submodule(path), name)
        for r in (0, 1):
            out[r][key] = rank_piece(t, split, 2, r)
    return out


def load_module(directory):
    ckpt = files.find_checkpoint(directory)
    return [safe_load.load(f)["module"] for f in ckpt.files]


def assert_identical(got, want):
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))[:10]
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
