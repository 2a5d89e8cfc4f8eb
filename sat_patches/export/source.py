"""A CogVLM/CogAgent SAT checkpoint read tensor by tensor, checked whole before anything is written.

:class:`SatCheckpoint` opens any checkpoint this package reads (model-parallel shards, LoRA merged or not, an
adapter-only save with its base), memory-mapped, with the model of its ``model_config.json`` built on meta for
every tensor's full shape and split. :meth:`SatCheckpoint.tensor` gives one full-size (MP=1) tensor at a time,
LoRA folded in.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch

from ..checkpoints import files, sharding
from ..checkpoints.files import CheckpointError
from ..checkpoints.lora_names import factor_key
from ..checkpoints.model_config import read_model_config
from ..cogvlm.on_meta import build_on_meta
from ..lora.layer import add_lora_product
from ..checkpoints.merge import adapter_base, float_dtype
from . import names

class ExportError(CheckpointError):
    """A checkpoint or folder that cannot be exported or imported as asked; says what to change."""


@dataclass
class Lora:
    """The LoRA of one layer, joined over model-parallel shards: ``A[i]`` (r x in), ``B[i]`` (rows_i x r)."""
    path: str
    A: List[torch.Tensor]
    B: List[torch.Tensor]
    scaling: float

    @property
    def rank(self) -> int:
        return self.A[0].shape[0]


def build_meta(config: dict, where: str = "model_config.json") -> torch.nn.Module:
    """The model of ``config`` at full size (model-parallel size 1) on meta: shapes and splits, no memory."""
    try:
        return build_on_meta(config, mp=1)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ExportError(f"{config.get('model_class')} cannot be built from {where} ({exc!r}): set the values the "
                          f"model was trained with") from exc


class SatCheckpoint:
    """The tensors of a SAT checkpoint of CogVLM or CogAgent, as full-size (MP=1) tensors, LoRA folded."""

    def __init__(self, path: str, iteration: Optional[int] = None, lora_alpha: float = 1.0):
        self.path = path
        self.ckpt = files.find_checkpoint(path, iteration)
        self.config = read_model_config(path, need_class=True)
        if self.config["model_class"].replace("FineTuneTrain", "") not in names.MODELS:
            raise ExportError(f"{path}: model_class {self.config['model_class']} (model_config.json) is not CogVLM "
                              f"or CogAgent ({', '.join(names.MODELS)}): only these have a Hugging Face layout here")
        self.config = dict(self.config, model_class=self.config["model_class"].replace("FineTuneTrain", ""))
        self.lora_alpha = lora_alpha
        self.own = sharding.ShardedSource(self.ckpt)
        self.base = adapter_base(self.ckpt, path)          # an adapter-only save: its base's shards
        self.model = build_meta(self.config, f"{path}/model_config.json")
        self.like = dict(self.model.state_dict(keep_vars=True))   # persistent tensors, on meta
        self._where: Dict[str, Tuple[sharding.ShardedSource, str]] = {}
        self.loras: Dict[str, List[str]] = {}
        self._check()

    def _check(self) -> None:
        unknown = []
        for source in [s for s in (self.own, self.base) if s is not None]:
            for key in source.keys():
                factor = factor_key(key)
                if factor:
                    if source is not self.own:
                        raise ExportError(f"{self.path}: its base {self.base.ckpt.path} holds LoRA matrices ('{key}'): "
                                          f"merge the base first (python -m sat_patches merge) and train from that")
                    self.loras.setdefault(factor.layer, []).append(key)
                    continue
                name = key.replace(".original.", ".")   # LoRA's x.original.weight is the base layer's x.weight
                if name not in self.like:
                    unknown.append(key)
                elif name not in self._where:           # the adapter's own save first, then its base
                    self._where[name] = (source, key)
        if unknown:
            raise ExportError(f"{self.path}: {len(unknown)} key(s) that {self.config['model_class']} of its "
                              f"model_config.json does not have, e.g. {unknown[:5]}: not a checkpoint of this "
                              f"model (or model_config.json does not describe it); nothing was written")
        missing = [k for k in self.like if k not in self._where]
        if missing:
            raise ExportError(f"{self.path}: lacks {len(missing)} tensor(s) of {self.config['model_class']}, e.g. "
                              f"{missing[:5]}: an incomplete checkpoint (an adapter-only save needs its base, "
                              f"named in adapter.json); nothing was written")
        for name, (source, key) in self._where.items():
            try:
                names.hf_names(name, self.config["num_layers"])   # every tensor has an HF name, or stop here
            except names.UnknownKeyError as exc:
                raise ExportError(f"{self.path}: {exc}; nothing was written") from exc
            source.pieces(key, self.like[name], self.split(name))  # shapes vs config (raises)
        for path in self.loras:
            if path + ".weight" not in self.like:
                raise ExportError(f"{self.path}: LoRA on '{path}', which is not a linear layer of "
                                  f"{self.config['model_class']}")
            self.lora(path)                                   # factor shapes (raises)
        self._check_vision_layers()

    def _check_vision_layers(self) -> None:
        layers = self.config["num_layers"]
        have = {int(m.group(1)) for k in self.like if (m := re.match(r"mixins\.rotary\.vision_dense_list\.(\d+)\.", k))}
        if have != set(range(layers)):
            raise ExportError(f"{self.path}: vision experts in layers {sorted(have)} of {layers}; the Hugging Face "
                              f"layout has them in every layer (build with all layers in vision_layer_range)")

    def split(self, name: str):
        path, _, attr = name.rpartition(".")
        return sharding.split_of(self.model, name, self.model.get_submodule(path), attr)

    def keys(self) -> List[str]:
        """Canonical SAT keys, in the model's order."""
        return list(self.like)

    def dtype(self) -> torch.dtype:
        return float_dtype(map(self.saved, self.keys()))

    def saved(self, name: str) -> torch.Tensor:
        """The tensor as shard 0 holds it (for its dtype)."""
        source, key = self._where[name]
        return source.state[0][key]

    def raw(self, name: str) -> torch.Tensor:
        """The full-size tensor as saved (a view of the mapped file when it is one piece), LoRA not folded."""
        source, key = self._where[name]
        like = torch.empty(self.like[name].shape, dtype=source.state[0][key].dtype, device="meta")
        return source.materialised(key, like, self.split(name), torch.device("cpu"))

    def tensor(self, name: str) -> torch.Tensor:
        """The full-size tensor with its layer's LoRA folded in (a new tensor then), else :meth:`raw`."""
        t = self.raw(name)
        path = name[: -len(".weight")] if name.endswith(".weight") else None
        if path in self.loras:
            raw, t = t, t.clone()
            self.release(raw)
            lora = self.lora(path)
            add_lora_product(t, SimpleNamespace(matrix_A=lora.A, matrix_B=lora.B, scaling=lora.scaling))
        return t

    def lora(self, path: str) -> Lora:
        """The LoRA factors of layer ``path``, joined over model-parallel shards."""
        kind = sharding.parallel_kind(self.model.get_submodule(path))
        count = len(self.loras[path]) // 2
        factors = {"A": [], "B": []}
        for factor in "AB":
            for i in range(count):
                key = f"{path}.matrix_{factor}.{i}"
                if key not in self.own:
                    raise ExportError(f"{self.path}: '{key}' missing: the LoRA of '{path}' is incomplete")
                split = sharding.lora_factor_split(kind, "matrix_" + factor)
                saved = self.own.state[0][key]
                full = list(saved.shape)
                if split is not None:
                    full[split.dim] *= self.ckpt.mp_size
                like = torch.empty(full, dtype=saved.dtype, device="meta")
                factors[factor].append(self.own.assembled(key, like, split))
        rank = factors["A"][0].shape[0]
        weight = self.like[path + ".weight"]
        rows = sum(b.shape[0] for b in factors["B"])
        if rows != weight.shape[0] or any(a.shape != (rank, weight.shape[1]) for a in factors["A"]) \
                or any(b.shape[1] != rank for b in factors["B"]):
            raise ExportError(f"{self.path}: the LoRA factors of '{path}' ({[tuple(a.shape) for a in factors['A']]}, "
                              f"{[tuple(b.shape) for b in factors['B']]}) do not fit its weight {tuple(weight.shape)}")
        return Lora(path, factors["A"], factors["B"], self.lora_alpha / rank)

    def release(self, t: torch.Tensor) -> None:
        """Drop the mapped pages a view of the checkpoint touched (no-op for new tensors)."""
        for source in (self.own, self.base):
            if source is not None and t.untyped_storage().data_ptr() in source.mapped_storages:
                sharding.release_pages(t)   # written out: nothing of the export keeps it
