"""Hugging Face folder of CogVLM / CogAgent -> SAT checkpoint (``sat-patches import hf HF_DIR OUT --mp N``;
THUDM/CogVLM2#123). The safetensors shards are memory-mapped (nothing is unpickled); every name, shape and shard
is checked against the model of ``config.json`` before anything is written.
"""
from __future__ import annotations

import os
from typing import Dict

import torch
from sat.model.position_embedding.triton_rotary_embeddings import FastRotaryEmbedding

from ..checkpoints import sharding, writer
from ..checkpoints.model_config import check_model_config, read_json_object
from . import names, stream
from .source import ExportError, build_meta


def shard_files(hf_dir: str) -> Dict[str, str]:
    """``{tensor name: safetensors file}`` of an HF folder (index or a single ``model.safetensors``),
    every file named there present."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_object(index, "", "download it again", ExportError).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportError(f"'{index}' has no weight_map: download it again")
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        header = stream.read_header(os.path.join(hf_dir, "model.safetensors"))
        return {k: "model.safetensors" for k in header if not k.startswith("__")}
    else:
        bins = [f for f in os.listdir(hf_dir) if f.endswith(".bin")]
        hint = (f" (it holds {', '.join(sorted(bins)[:3])}: pickled weights are not read; convert them with "
                f"transformers' save_pretrained(safe_serialization=True) first)") if bins else ""
        raise ExportError(f"'{hf_dir}' has neither model.safetensors.index.json nor model.safetensors{hint}")
    missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(hf_dir, f))})
    if missing:
        raise ExportError(f"'{hf_dir}' lacks shard(s) {', '.join(missing)} named by model.safetensors.index.json: "
                          f"copy or download them")
    return dict(weight_map)


def rank_piece(full: torch.Tensor, split, mp: int, rank: int) -> torch.Tensor:
    """Model-parallel rank ``rank`` of ``mp``'s slice of a full-size tensor (a copy), by SAT's split rules."""
    if split is None or mp == 1:
        return full
    d = split.dim
    pieces = sharding._pieces(split, full.shape[d], 1, mp, rank)
    return torch.cat([full.narrow(d, start, n) for _, _, start, n in pieces], dim=d).clone()


def import_hf(hf_dir: str, out: str, mp: int = 1, overwrite: bool = False) -> dict:
    """Write the SAT checkpoint of the HF folder ``hf_dir`` at ``out`` (model-parallel size ``mp``)."""
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out} exists; choose a new output folder or pass --overwrite")
    if not os.path.isdir(hf_dir):
        raise ExportError(f"'{hf_dir}' is not a folder: pass the Hugging Face model folder (config.json and "
                          f"model-*.safetensors)")
    hf = read_json_object(os.path.join(hf_dir, "config.json"), "pass a Hugging Face model folder (config.json and "
                          "model-*.safetensors) of CogVLM or CogAgent", "fix it or download it again", ExportError)
    try:
        config = names.sat_config(hf, mp)
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"'{hf_dir}/config.json' is not a CogVLM/CogAgent configuration ({exc!r}): pass the "
                          f"folder of THUDM/cogvlm-*-hf or cogagent-*-hf, or of `sat-patches export hf`") from exc
    check_model_config(config, os.path.join(hf_dir, "config.json"))
    located = shard_files(hf_dir)
    headers = {f: stream.read_header(os.path.join(hf_dir, f)) for f in sorted(set(located.values()))}
    unknown = [n for n in located if n not in headers[located[n]]]
    if unknown:
        raise ExportError(f"model.safetensors.index.json names {unknown[:5]}, absent from their shard files: "
                          f"download the folder again")
    model = build_meta(config, os.path.join(hf_dir, "config.json"))
    like = dict(model.state_dict(keep_vars=True))
    by_sat: Dict[str, list] = {}
    bad = []
    for name in located:
        try:
            key = names.sat_name(name)
        except names.UnknownKeyError:
            key = None
        if key in like:
            by_sat.setdefault(key, []).append(name)
        else:
            bad.append(name)
    if bad:
        raise ExportError(f"'{hf_dir}': {len(bad)} tensor(s) that {config['model_class']} of its config.json does "
                          f"not have, e.g. {bad[:5]}: not this model, or config.json does not describe it; nothing "
                          f"was written")
    computed = {}
    if names.INV_FREQ in like and names.INV_FREQ not in by_sat:  # saved without the rotary buffers: SAT's own
        dim = config["hidden_size"] // config["num_attention_heads"]
        computed[names.INV_FREQ] = FastRotaryEmbedding(dim, pos_idx_in_fp32=False, device="cpu").inv_freq
        by_sat[names.INV_FREQ] = []
    missing = [k for k in like if k not in by_sat]
    layers = config["num_layers"]
    if names.INV_FREQ in by_sat and not computed and len(by_sat[names.INV_FREQ]) != layers:
        missing.append(names.HF_INV_FREQ.format("N") + f" ({len(by_sat[names.INV_FREQ])} of {layers} layers)")
    if missing:
        raise ExportError(f"'{hf_dir}' lacks {len(missing)} tensor(s) of {config['model_class']}, e.g. "
                          f"{missing[:5]}: an incomplete download; nothing was written")
    splits = {}
    for key, hf_names in by_sat.items():
        for name in hf_names if key not in computed else []:
            info = headers[located[name]][name]
            if tuple(info["shape"]) != tuple(like[key].shape):
                raise ExportError(f"'{name}' is {tuple(info['shape'])} in '{hf_dir}', but {config['model_class']} "
                                  f"of its config.json has {tuple(like[key].shape)}: config.json and the weights "
                                  f"disagree")
        path, _, attr = key.rpartition(".")
        splits[key] = sharding.split_of(model, key, model.get_submodule(path), attr)
        if splits[key] is not None and mp > 1:
            try:
                sharding._pieces(splits[key], like[key].shape[splits[key].dim], 1, mp, 0)
            except ValueError as exc:
                raise ExportError(f"'{key}' of shape {tuple(like[key].shape)} cannot be split over {mp} model-"
                                  f"parallel ranks ({exc}): choose an --mp that divides the heads and sizes") from exc
    mapped = {f: stream.mapped_tensors(os.path.join(hf_dir, f), h) for f, h in headers.items()}

    def full(key: str) -> torch.Tensor:
        if key in computed:
            return computed[key]
        tensors = [mapped[located[n]][n] for n in by_sat[key]]
        if any(not torch.equal(tensors[0], t) for t in tensors[1:]):
            raise ExportError(f"'{hf_dir}': the layers' {by_sat[key][0].rsplit('.', 2)[-2]} buffers differ; SAT "
                              f"keeps one for the model")
        return tensors[0]

    with writer.new_dir(out, writer.publish_checkpoint_dir) as tmp:   # staged, renamed into place once complete
        for rank in range(mp):
            module = {key: rank_piece(full(key), splits[key], mp, rank) for key in like}
            writer.write_layout(tmp, 1, {rank: {"module": module, "iteration": 1}}, latest=False)
            del module
        writer.write_layout(tmp, 1, {}, config)
    return {"model_class": config["model_class"], "mp_size": mp, "tensors": len(like)}

