"""Model-parallel split and merge of the LoRA layers of a state dict (tests compare MP runs with MP=1)."""
from __future__ import annotations

from typing import Dict, List, Mapping, NamedTuple, Sequence, Union

import torch
from torch import nn

from sat_patches.checkpoints.sharding import COLUMN, ROW, lora_factor_split, parallel_kind
from sat_patches.lora.layer import is_lora_layer, segment_sizes


class LoraLayout(NamedTuple):
    kind: str  # "column" | "row" | "plain": the base layer's parallel type
    partition: Union[int, List[int]]  # SAT's partition: stacked outputs (3 for QKV) or their ratios


def lora_layout(model: nn.Module) -> Dict[str, LoraLayout]:
    """``{module name: LoraLayout}`` for every LoRA layer of ``model`` (these patches' or stock SAT's)."""
    return {name: LoraLayout(getattr(m, "kind", None) or parallel_kind(m.original), m.partition)
            for name, m in model.named_modules() if is_lora_layer(m)}


def _rule(kind: str, suffix: str) -> str:
    factor = suffix.partition(".")[0]
    if factor in ("matrix_A", "matrix_B"):
        split = lora_factor_split(kind, factor)
        return "copy" if split is None else ("rows", "cols")[split.dim]
    if suffix == "original.weight":
        return {COLUMN: "segments", ROW: "cols"}.get(kind, "copy")
    if suffix == "original.bias":
        return "segments" if kind == COLUMN else "copy"
    raise ValueError(f"don't know how to split LoRA layer key '{suffix}' (QLoRA states are not supported)")


def _lora_keys(state_dict: Mapping, layout: Mapping[str, LoraLayout]):
    """(key, layout, rule) for every key of ``state_dict`` under a LoRA layer."""
    for key in state_dict:
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            owner = ".".join(parts[:cut])
            if owner in layout:
                yield key, layout[owner], _rule(layout[owner].kind, ".".join(parts[cut:]))
                break


def _even(t: torch.Tensor, n: int, dim: int) -> List[torch.Tensor]:
    if t.shape[dim] % n:
        raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor does not split into {n}")
    return list(t.split(t.shape[dim] // n, dim))


def _split(t: torch.Tensor, rule: str, n: int, partition) -> List[torch.Tensor]:
    if rule == "copy":
        return [t] * n
    if rule in ("rows", "cols"):
        return [p.clone() for p in _even(t, n, 0 if rule == "rows" else 1)]
    pieces = [_even(seg, n, 0) for seg in t.split(segment_sizes(t.shape[0], partition))]
    return [torch.cat([p[rank] for p in pieces]) for rank in range(n)]


def _merge(ts: Sequence[torch.Tensor], rule: str, partition) -> torch.Tensor:
    if rule == "copy":
        return ts[0]
    if rule in ("rows", "cols"):
        return torch.cat(list(ts), 0 if rule == "rows" else 1)
    segs = [t.split(segment_sizes(t.shape[0], partition)) for t in ts]
    return torch.cat([seg[i] for i in range(len(segs[0])) for seg in segs])


def _as_layout(layout) -> Mapping[str, LoraLayout]:
    return lora_layout(layout) if isinstance(layout, nn.Module) else layout


def split_lora_state_dict(state_dict: Mapping[str, torch.Tensor], layout,
                          mp_size: int) -> List[Dict[str, torch.Tensor]]:
    """Split the LoRA layers of an MP=1 state dict into ``mp_size`` per-rank state dicts.

    ``layout`` is a model with LoRA layers (any MP size; only its structure is read) or the dict
    :func:`lora_layout` returns. Returns one dict per model-parallel rank holding exactly the keys
    of ``state_dict`` under LoRA layers (``original.weight/bias``, ``matrix_A.i``, ``matrix_B.i``);
    every other key is the caller's. Split tensors are fresh copies; replicated ones are shared.
    """
    shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(mp_size)]
    for key, lay, rule in _lora_keys(state_dict, _as_layout(layout)):
        for shard, piece in zip(shards, _split(state_dict[key], rule, mp_size, lay.partition)):
            shard[key] = piece
    return shards


def merge_lora_state_dicts(state_dicts: Sequence[Mapping[str, torch.Tensor]],
                           layout) -> Dict[str, torch.Tensor]:
    """Merge the LoRA layers of per-rank state dicts (model-parallel rank order) into one MP=1 dict.

    The inverse of :func:`split_lora_state_dict`; replicated tensors are taken from rank 0. Returns
    only the keys under LoRA layers.
    """
    return {key: _merge([sd[key] for sd in state_dicts], rule, lay.partition)
            for key, lay, rule in _lora_keys(state_dicts[0], _as_layout(layout))}


