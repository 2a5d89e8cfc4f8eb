"""Checkpoint directories found and checked before any weight is read: a missing, empty or truncated one stops
with a :class:`CheckpointError` saying what to change.
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass
from typing import List, Optional, Tuple

from . import safe_load
from .model_config import SIZE_LIMITS, CheckpointError


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
        saved = sorted((int(e) for e in entries if e.isdigit() and os.path.isdir(os.path.join(load_path, e))))
        raise CheckpointError(f"'{load_path}' has no directory '{os.path.basename(folder)}' for iteration "
                              f"{'release' if release else iteration} (from 'latest', or --iteration): saved "
                              f"iterations: {', '.join(map(str, saved)) or 'none'}; choose one of them, or fix "
                              f"'latest' or restore that directory")
    shards = {int(m.group(1)): os.path.join(folder, f) for f in os.listdir(folder) if (m := _SHARD.match(f))}
    if not shards:
        raise CheckpointError(f"'{folder}' holds no mp_rank_XX_model_states.pt (it has: "
                              f"{', '.join(sorted(os.listdir(folder))) or 'nothing'}): the checkpoint is "
                              f"incomplete, or was saved under ZeRO-3 (z3_rank_* files)")
    highest = max(shards)
    if highest >= SIZE_LIMITS["model_parallel_size"]:
        raise CheckpointError(f"'{shards[highest]}' names model-parallel rank {highest}, beyond the largest model-parallel "
                              f"size taken ({SIZE_LIMITS['model_parallel_size']}): remove the stray file")
    size, source = expected_mp_size(load_path, folder, highest + 1)
    missing = sorted(set(range(size)) - set(shards))
    if missing:
        names = ", ".join(f"mp_rank_{i:02d}_model_states.pt" for i in missing)
        raise CheckpointError(f"'{folder}' lacks model-parallel shard(s) {missing} of {size} ({source}): "
                              f"copy the missing {names}")
    files = [shards[i] for i in range(len(shards))]
    for f in files:
        size = os.path.getsize(f)
        if size == 0 or not zipfile.is_zipfile(f):
            raise CheckpointError(f"'{f}' is truncated or not a torch checkpoint ({size} bytes, no zip "
                                  f"directory at its end): copy or download it again")
    return Checkpoint(load_path, iteration, release, files)


_OPTIM_MP = re.compile(r"_mp_rank_(\d+)_optim_states\.pt$")


def expected_mp_size(load_path: str, folder: str, from_shards: int) -> Tuple[int, str]:
    """How many model-parallel shards the iteration should hold, and what says so: the highest
    shard present, the ``model_parallel_size`` of ``model_config.json`` (what the saving run had), and
    the model-parallel ranks named by its optimizer shards; the largest wins (a missing last shard
    leaves no gap among the others)."""
    size, source = from_shards, "the highest shard present"
    try:
        with open(os.path.join(load_path, "model_config.json"), encoding="utf-8") as f:
            declared = json.load(f).get("model_parallel_size")
    except (OSError, ValueError, AttributeError):
        declared = None
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > size:
        size, source = declared, f"model_config.json says model_parallel_size {declared}"
    optim = [int(m.group(1)) + 1 for f in os.listdir(folder) if (m := _OPTIM_MP.search(f))]
    if optim and max(optim) > size:
        size, source = max(optim), f"optimizer shards of model-parallel rank {max(optim) - 1} are there"
    limit = SIZE_LIMITS["model_parallel_size"]
    if size > limit:  # checked before any list of shard numbers is built from it
        raise CheckpointError(f"'{folder}': {source}, beyond the largest model-parallel size taken ({limit}): fix "
                              f"model_parallel_size in model_config.json, or remove the stray files")
    return size, source


def missing_optimizer_shards(folder: str, dp_size: int, mp_size: int) -> List[str]:
    """The ZeRO optimizer shards (``[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt``, one per
    data-parallel rank D and model-parallel rank MM) absent, empty or truncated in ``folder``: none
    when the iteration holds no optimizer shard at all (saved without, or without ZeRO)."""
    present = [f for f in os.listdir(folder) if f.endswith("_optim_states.pt")]
    if not present:
        return []
    prefix = "bf16_" if any(f.startswith("bf16_") for f in present) else ""
    missing = []
    for dp in range(dp_size):
        for mp in range(mp_size):
            name = f"{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
            path = os.path.join(folder, name)
            if not os.path.isfile(path) or os.path.getsize(path) == 0 or not zipfile.is_zipfile(path):
                missing.append(name)
    return missing


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
