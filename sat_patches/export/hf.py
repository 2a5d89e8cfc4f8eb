"""SAT checkpoint -> Hugging Face folder of CogVLM / CogAgent (``sat-patches export hf CKPT OUT``; asked for in
THUDM/CogVLM#439, #415, #241, #302).

Any checkpoint :class:`~sat_patches.export.source.SatCheckpoint` reads becomes the layout of
``THUDM/cogvlm-chat-hf`` / ``cogagent-chat-hf`` (``config.json``, ``generation_config.json``, safetensors shards
and their index), streamed one tensor at a time. ``config.json``'s ``auto_map`` names the released hub
repository's code, or with ``hf_code`` the ``.py`` files copied from the user's local copy of it (loads offline).
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Optional

import torch

from ..checkpoints import writer
from . import names, stream
from .source import ExportError, SatCheckpoint

DEFAULT_SHARD_BYTES = 2 * 10**9
_CODE = {"CogVLMModel": ("modeling_cogvlm.py", "configuration_cogvlm.py"),
         "CogAgentModel": ("modeling_cogagent.py", "configuration_cogagent.py")}


def check_hf_code(directory: str, model_class: str) -> list:
    """The ``.py`` files of the user's copy of the model's hub repository, refused when it lacks the model's."""
    if not os.path.isdir(directory):
        raise ExportError(f"--hf-code {directory}: no such folder (pass your local copy of the model's hub "
                          f"repository, e.g. a download of THUDM/cogvlm-chat-hf)")
    have = sorted(f for f in os.listdir(directory) if f.endswith(".py"))
    missing = [f for f in _CODE[model_class] if f not in have]
    if missing:
        raise ExportError(f"--hf-code {directory} lacks {', '.join(missing)}: pass the hub repository of "
                          f"{names.MODELS[model_class]} (its modeling and configuration files)")
    return [os.path.join(directory, f) for f in have]


def export_hf(checkpoint: str, out: str, iteration: Optional[int] = None, lora_alpha: float = 1.0,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
              hf_code: Optional[str] = None) -> dict:
    """Write the HF folder of ``checkpoint`` at ``out``. Raises :class:`ExportError` (or a
    :class:`~sat_patches.checkpoints.files.CheckpointError`) before writing anything for input it cannot use."""
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out} exists; choose a new output folder or pass --overwrite")
    src = SatCheckpoint(checkpoint, iteration, lora_alpha)
    code = check_hf_code(hf_code, src.config["model_class"]) if hf_code else []
    layers = src.config["num_layers"]
    to_sat = dict(names.hf_items(src.keys(), layers))
    items = sorted(((hf, tuple(src.like[sat].shape), src.saved(sat).dtype) for hf, sat in to_sat.items()),
                   key=lambda item: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", item[0])])
    shards = stream.shard_plan(items, max_shard_bytes)
    n = len(shards)
    weight_map, total = {}, 0
    dtype_name = str(src.dtype()).replace("torch.", "")
    config = names.hf_config(src.config, dtype_name, local_code=bool(code))

    def produce(hf_name: str) -> torch.Tensor:
        t = src.tensor(to_sat[hf_name])
        return t.clone() if to_sat[hf_name] == names.INV_FREQ else t

    with writer.new_dir(out) as tmp:
        for i, plan in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{n:05d}.safetensors"
            total += stream.write_safetensors(os.path.join(tmp, file), plan, produce, src.release)
            weight_map.update({name: file for name, _, _ in plan})
        stream.write_json(os.path.join(tmp, "model.safetensors.index.json"),
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
        stream.write_json(os.path.join(tmp, "config.json"), config)
        stream.write_json(os.path.join(tmp, "generation_config.json"), names.generation_config(config))
        for f in code:
            shutil.copy2(f, tmp)
    return {"model_class": src.config["model_class"], "shards": n, "bytes": total, "tensors": len(weight_map),
            "mp_size": src.ckpt.mp_size, "lora_layers": len(src.loras), "adapter_only": src.base is not None}
