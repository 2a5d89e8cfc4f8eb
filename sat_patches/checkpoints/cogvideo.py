"""CogVideoX runs (THUDM/CogVideo's ``sat/``): the LoRA folded into the DiT (``sat-patches merge RUN OUT``) and its
factors in diffusers' layout (``sat-patches export diffusers RUN OUT``), from the checkpoint and the run's saved
config alone: no model is built, so neither CogVideoX's code nor T5 or the VAE is needed.

A run's folder, as ``train_video.py`` leaves it, holds SAT's checkpoint (adapter-only, with ``adapter.json`` naming
its base, or whole) and ``training_config.yaml`` (its ``--base`` configs merged), whose ``lora_config`` gives
``lora_alpha`` (LoraMixin's default 1): SAT's LoRA adds ``lora_alpha / r * B_i @ A_i`` to the i-th block of rows
(Q, K, V of ``query_key_value``). Model-parallel shards are joined by the split of SAT's parallel layers.
"""
from __future__ import annotations

import os
import re
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
import yaml  # transformers' dependency: there wherever SAT is

from ..export import stream
from ..lora.layer import add_lora_product
from . import files, sharding, writer
from .files import CheckpointError
from .lora_names import FACTOR_A, FACTOR_B, factor_key, lora_layers
from .merge import MergeError, adapter_base

CONFIG = "training_config.yaml"
FROZEN = ("conditioner.", "first_stage_model.")  # T5 and the VAE: not trained, not in released checkpoints
# the split of SAT's model-parallel layers in the DiT (BaseTransformer's); every other tensor is whole on each rank
_SPLITS = ((".attention.query_key_value.", sharding.Split(0, (1, 1, 1))), (".mlp.dense_h_to_4h.", sharding.Split(0)),
           (".attention.dense.weight", sharding.Split(1)), (".mlp.dense_4h_to_h.weight", sharding.Split(1)))
_LAYER = re.compile(r"(?:^|\.)transformer\.layers\.(\d+)\.attention\.(query_key_value|dense)$")
_DIFFUSERS = {"query_key_value": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "dense": ("attn1.to_out.0",)}
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' load_lora_weights(folder) looks for


def is_video_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


def config_lora_alpha(path: str) -> Optional[float]:
    """``lora_alpha`` of the run's ``training_config.yaml`` (1, LoraMixin's default, when its lora_config names
    none); None without that file."""
    if not is_video_run(path):
        return None
    with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    lora = ((((config.get("model") or {}).get("network_config") or {}).get("params") or {}).get("modules") or {}) \
        .get("lora_config")
    if not lora:
        raise MergeError(f"{path}/{CONFIG} has no model.network_config.params.modules.lora_config: not a LoRA run")
    return float((lora.get("params") or {}).get("lora_alpha", 1.0))


class VideoRun:
    """The tensors of a CogVideoX run's checkpoint (and of the base an adapter-only save names), joined to MP=1."""

    def __init__(self, path: str, iteration: Optional[int] = None, lora_alpha: Optional[float] = None):
        self.path = path
        self.ckpt = files.find_checkpoint(path, iteration)
        self.alpha = lora_alpha if lora_alpha is not None else config_lora_alpha(path)
        if self.alpha is None:
            raise MergeError(f"{path} has no {CONFIG} (train_video.py writes it into the run's folder): pass "
                             f"--lora-alpha, the lora_config's lora_alpha (LoraMixin's default: 1)")
        self.own = sharding.ShardedSource(self.ckpt)
        self.base = adapter_base(self.ckpt, path)  # an adapter-only save: its base's shards, fingerprint checked
        self.loras = lora_layers(self.own.keys())

    def tensor(self, source: sharding.ShardedSource, key: str) -> torch.Tensor:
        """``key`` of ``source`` at full size: model-parallel shards joined by their layer's split."""
        shards = [state[key] for state in source.state]
        if len(shards) == 1:
            return shards[0]
        factor = factor_key(key)
        if factor:
            kind = sharding.ROW if factor.layer.endswith(".dense") else sharding.COLUMN  # lora2's attention layers
            split = sharding.lora_factor_split(kind, factor.factor)
        else:
            name = key.replace(".original.", ".")
            split = next((s for part, s in _SPLITS if part in name), None)
        if split is None:
            if any(not torch.equal(shards[0], s) for s in shards[1:]):
                raise MergeError(f"{self.path}: '{key}' differs between the model-parallel shards, and its split is "
                                 f"not SAT's attention/MLP layers': merge it with the model's code")
            return shards[0]
        full = list(shards[0].shape)
        full[split.dim] *= len(shards)
        return source.assembled(key, torch.empty(full, dtype=shards[0].dtype, device="meta"), split)

    def lora(self, layer: str):
        """``(A_i list, B_i list, scaling)`` of one LoRA layer, joined."""
        get = [[self.tensor(self.own, f"{layer}.{f}.{i}") for i in range(self.loras[layer])]
               for f in (FACTOR_A, FACTOR_B)]
        return get[0], get[1], self.alpha / get[0][0].shape[0]


def merge(path: str, out: str, lora_alpha: Optional[float] = None, iteration: Optional[int] = None,
          overwrite: bool = False) -> dict:
    """Write the run's DiT at MP=1 with its LoRA folded in, the released checkpoints' layout (LoRA layers' weights
    as ``<layer>.weight``, no T5 or VAE): a checkpoint ``sample_video.py`` loads with ``--load OUT`` under the
    configs without ``lora_config``."""
    if os.path.exists(out) and not overwrite:
        raise MergeError(f"{out} exists; choose a new OUTPUT_DIR or pass --overwrite")
    run = VideoRun(path, iteration, lora_alpha)
    state: Dict[str, torch.Tensor] = {}
    for source in [s for s in (run.own, run.base) if s is not None]:  # the run's own tensors before its base's
        for key in source.keys():
            name = key.replace(".original.", ".")
            if factor_key(key) is None and not key.startswith(FROZEN) and name not in state:
                state[name] = run.tensor(source, key)
    for layer in run.loras:
        if layer + ".weight" not in state:
            raise MergeError(f"{path}: LoRA on '{layer}' but neither the run nor its base holds '{layer}.weight'")
        a, b, scaling = run.lora(layer)
        state[layer + ".weight"] = weight = state[layer + ".weight"].clone()
        add_lora_product(weight, SimpleNamespace(matrix_A=a, matrix_B=b, scaling=scaling))
    with writer.new_dir(out, writer.publish_checkpoint_dir) as tmp:
        writer.write_layout(tmp, 1, {0: {"module": state, "iteration": 1}})
    return {"shards": run.ckpt.mp_size, "lora_layers": len(run.loras), "iteration": run.ckpt.iteration}


def diffusers_lora(run: VideoRun) -> Dict[str, torch.Tensor]:
    """The run's LoRA under diffusers' CogVideoX names, ``lora_alpha / r`` folded into each B (diffusers reads no
    alpha for CogVideoX: its scale is then 1, and the update is SAT's)."""
    tensors: Dict[str, torch.Tensor] = {}
    for layer in sorted(run.loras, key=lambda k: [int(p) if p.isdigit() else p for p in k.split(".")]):
        found = _LAYER.search(layer)
        targets: List[str] = _DIFFUSERS[found.group(2)] if found else []
        if len(targets) != run.loras[layer]:
            raise CheckpointError(f"{run.path}: LoRA on '{layer}' ({run.loras[layer]} part(s)): diffusers' CogVideoX "
                                  f"layout has LoRA on attention's query_key_value (Q, K, V) and dense only")
        a, b, scaling = run.lora(layer)
        for target, a_i, b_i in zip(targets, a, b):
            name = f"transformer.transformer_blocks.{found.group(1)}.{target}"
            tensors[f"{name}.lora_A.weight"] = a_i.contiguous()
            tensors[f"{name}.lora_B.weight"] = (b_i.float() * scaling).to(b_i.dtype)
    if not tensors:
        raise CheckpointError(f"{run.path} holds no LoRA matrices (matrix_A/matrix_B): nothing to export")
    return tensors


def export_diffusers(path: str, out: str, iteration: Optional[int] = None, lora_alpha: Optional[float] = None,
                     overwrite: bool = False) -> dict:
    """``out/pytorch_lora_weights.safetensors``: the run's LoRA for ``pipe.load_lora_weights(out)``."""
    if os.path.exists(out) and not overwrite:
        raise CheckpointError(f"{out} exists; choose a new output folder or pass --overwrite")
    run = VideoRun(path, iteration, lora_alpha)
    tensors = diffusers_lora(run)
    plan = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    with writer.new_dir(out) as tmp:
        stream.write_safetensors(os.path.join(tmp, DIFFUSERS_FILE), plan, tensors.__getitem__)
    return {"tensors": len(tensors), "layers": len(run.loras), "shards": run.ckpt.mp_size, "alpha": run.alpha}
