"""Checkpoint directories and ``model_config.json``: found and checked before any weight is read.

Bad input (missing/empty/truncated checkpoint directory, a ``model_config.json`` without the fields
SAT needs) stops with a :class:`CheckpointError` saying what to change, before the model is built.
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from . import safe_load

REQUIRED_CONFIG = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


class CheckpointError(ValueError):
    """A checkpoint directory or ``model_config.json`` that cannot be loaded; says what to change."""


_SHARD = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


@dataclass
class Checkpoint:
    """One iteration of a SAT checkpoint directory: ``files[i]`` is model-parallel shard ``i``."""
    path: str
    iteration: int
    release: bool
    files: List[str]

    @property
    def mp_size(self) -> int:
        return len(self.files)

    def open(self, shard: int) -> dict:
        """The shard's saved dict, memory-mapped: tensors are read only when used. Unpickled with
        ``weights_only=True`` and the types SAT/DeepSpeed saves hold (:mod:`.safe_load`)."""
        try:
            return safe_load.load(self.files[shard], map_location="cpu", mmap=True)
        except safe_load.UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read checkpoint file '{self.files[shard]}' ({exc}): it is "
                                  f"damaged or incomplete; copy or download it again") from exc


def find_checkpoint(load_path: str, specific_iteration: Optional[int] = None) -> Checkpoint:
    """Check a SAT checkpoint directory without reading any weights; raise :class:`CheckpointError`."""
    if not load_path or not os.path.isdir(load_path):
        raise CheckpointError(f"checkpoint directory '{load_path}' does not exist: pass the directory "
                              f"that holds 'latest' and model_config.json (--load, or from_pretrained's name)")
    entries = sorted(os.listdir(load_path))
    if not entries:
        raise CheckpointError(f"checkpoint directory '{load_path}' is empty: the download or copy did not "
                              f"finish, or the path points at the wrong directory")
    if specific_iteration is not None:
        iteration, release = int(specific_iteration), False
    else:
        iteration, release = _read_latest(load_path, entries)
    folder = os.path.join(load_path, "release" if release else str(iteration))
    if not os.path.isdir(folder):
        raise CheckpointError(f"'{load_path}' has no directory '{os.path.basename(folder)}' for iteration "
                              f"{'release' if release else iteration} (from 'latest' or specific_iteration): "
                              f"fix 'latest' or restore that directory")
    shards = {int(m.group(1)): os.path.join(folder, f) for f in os.listdir(folder) if (m := _SHARD.match(f))}
    if not shards:
        raise CheckpointError(f"'{folder}' holds no mp_rank_XX_model_states.pt (it has: "
                              f"{', '.join(sorted(os.listdir(folder))) or 'nothing'}): the checkpoint is "
                              f"incomplete, or was saved under ZeRO-3 (z3_rank_* files)")
    missing = sorted(set(range(max(shards) + 1)) - set(shards))
    if missing:
        raise CheckpointError(f"'{folder}' lacks model-parallel shard(s) {missing} of {max(shards) + 1}: "
                              f"copy the missing mp_rank_XX_model_states.pt files")
    files = [shards[i] for i in range(len(shards))]
    for f in files:
        size = os.path.getsize(f)
        if size == 0 or not zipfile.is_zipfile(f):
            raise CheckpointError(f"'{f}' is truncated or not a torch checkpoint ({size} bytes, no zip "
                                  f"directory at its end): copy or download it again")
    return Checkpoint(load_path, iteration, release, files)


def _read_latest(load_path: str, entries: List[str]) -> Tuple[int, bool]:
    tracker = os.path.join(load_path, "latest")
    if not os.path.isfile(tracker):
        numbered = [e for e in entries if e.isdigit()]
        hint = f" e.g. `echo {max(numbered, key=int)} > {tracker}`" if numbered else ""
        raise CheckpointError(f"'{load_path}' has no 'latest' file naming the iteration to load: write "
                              f"it{hint}, or pass specific_iteration")
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    if text.isdigit() and int(text) > 0:
        return int(text), False
    raise CheckpointError(f"'{tracker}' says {text!r}: it must hold an iteration number > 0 or 'release'")


def read_model_config(model_path: str, need_class: bool = False) -> dict:
    """``model_config.json`` of a checkpoint, checked for the fields SAT builds a model from."""
    path = os.path.join(model_path, "model_config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"'{path}' not found: from_pretrained builds the model from it (SAT's "
                              f"save_checkpoint writes it next to 'latest'); copy it from the model's source")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"'{path}' is not valid JSON ({exc}): fix or re-create it") from exc
    need = REQUIRED_CONFIG + (("model_class",) if need_class else ())
    missing = [k for k in need if k not in config]
    if missing:
        example = '"hidden_size": 4096' + (', "model_class": "CogVLMModel"' if "model_class" in missing else "")
        raise CheckpointError(f"'{path}' lacks {', '.join(missing)}: add them with the values the checkpoint "
                              f"was trained with (e.g. {example})")
    return config
