"""Checkpoints load with little host memory, rank-locally, at any model-parallel size (issue 5).

What SAT 0.4.12 does (field notes, "Host memory"): ``load_checkpoint`` ``torch.load``s the whole file
into RAM on every rank; ``from_pretrained(..., overwrite_args={'model_parallel_size': n})`` makes the
node's rank 0 build the full MP=1 model on CPU, load the whole checkpoint into it and ``.cuda()`` +
``send`` every partition (SAT 173, CogVLM 283/320/162); it mutates the caller's ``args`` and
``overwrite_args``; from an MP=N checkpoint to MP=N it raises "model_parallel_size is inconsistent"
(CogVLM 233).

Here:

* Checkpoint files are opened with ``torch.load(mmap=True)``: nothing is read until a tensor is
  copied, and each tensor is copied in chunks of at most :data:`CHUNK_BYTES`, converted to the
  model's dtype on the way, straight into the parameter on its device; the pages of the mapped file
  a chunk touched are released after it (``madvise(MADV_DONTNEED)``), so a rank's peak is its own
  share of the model plus one chunk.
* Any model-parallel size loads from any other: every rank reads only its own slice of each split
  tensor (Column/Row/VocabParallel, ColumnParallel ``stride`` blocks of a fused QKV, LoRA A/B via
  :mod:`sat_patches.lora`) from the mapped shard files. Nothing is built in full and nothing is sent
  between ranks. A split tensor this module cannot place stops the load with a message naming
  :data:`MERGE_COMMAND`.
* ``from_pretrained`` builds the model on meta (no memory, no init) and materialises it from the
  checkpoint by assignment; when the checkpoint cannot fill every tensor (new mixins), it builds on
  the compute device instead (initialised, as SAT does) and loads into it.
* Bad input (missing/empty/truncated checkpoint directory, a ``model_config.json`` without the
  fields SAT needs) stops with a message saying what to change, before the model is built.
* Ranks meet behind a barrier with a timeout (``SAT_PATCHES_LOAD_TIMEOUT`` seconds, default 1800)
  whose message names the stage each late rank is at.
* ``LOCAL_WORLD_SIZE`` is checked against the ranks that really share a node (SAT's node groups are
  empty with ``LOCAL_WORLD_SIZE=8`` on a 2-GPU box) and ``experiment_name`` is decided on rank 0
  (CogVLM 269: per-rank timestamps split one run's checkpoints across directories).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import datetime
import functools
import json
import mmap
import os
import re
import socket
import sys
import time
import warnings
import zipfile
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import construction, devices
from ._registry import Patch, SatPatchesWarning, expect_names, expect_params
from .settings import env_seconds

CHUNK_BYTES = int(float(os.environ.get("SAT_PATCHES_LOAD_CHUNK_MB", "64")) * 2**20)
"""Largest piece of a checkpoint tensor read at once (``SAT_PATCHES_LOAD_CHUNK_MB``, default 64)."""
MERGE_COMMAND = "python -m sat_patches.merge"
REQUIRED_CONFIG = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


class CheckpointError(ValueError):
    """A checkpoint directory or ``model_config.json`` that cannot be loaded; says what to change."""


class LoadTimeout(RuntimeError):
    """Other ranks did not reach a loading barrier in time; names the stage they are at."""


def load_timeout() -> float:
    return env_seconds("SAT_PATCHES_LOAD_TIMEOUT", 1800.0, what=" that loading may take")


# --------------------------------------------------------------------------------------
# Checkpoint directories
# --------------------------------------------------------------------------------------

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
        """The shard's saved dict, memory-mapped: tensors are read only when used. (Unpickled in full,
        as SAT does: SAT/DeepSpeed checkpoints hold numpy RNG states that weights_only=True refuses.)"""
        try:
            return torch.load(self.files[shard], map_location="cpu", mmap=True, weights_only=False)
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


# --------------------------------------------------------------------------------------
# How tensors are split across model-parallel ranks
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """A tensor split along ``dim``; ``blocks`` are the relative sizes of stacked parts that are each
    split evenly (ColumnParallel ``stride``: Q, K, V of a fused QKV), ``(1,)`` for a plain split."""
    dim: int
    blocks: Tuple[int, ...] = (1,)


REPLICATED = None
SplitRule = Callable[[torch.nn.Module, str, str], Optional[Split]]
_split_rules: List[SplitRule] = []


def register_split_rule(rule: SplitRule) -> SplitRule:
    """Teach the loader a split: ``rule(model, key, name)`` returns a :class:`Split`, ``"replicated"``
    or None (not mine). ``key`` is the state-dict key, ``name`` the tensor's attribute name."""
    _split_rules.append(rule)
    return rule


def _strides(stride) -> Tuple[int, ...]:
    return (1,) * stride if isinstance(stride, int) else tuple(stride)


def split_of(model: torch.nn.Module, key: str, owner: torch.nn.Module, name: str):
    """The :class:`Split` of ``owner.<name>`` (state-dict ``key``), or None when every rank holds it whole."""
    for rule in _split_rules:
        found = rule(model, key, name)
        if found is not None:
            return None if found == "replicated" else found
    from sat.mpu import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    if isinstance(owner, ColumnParallelLinear) and name in ("weight", "bias"):
        return Split(0, _strides(owner.stride))
    if isinstance(owner, RowParallelLinear) and name == "weight":
        return Split(1)
    if isinstance(owner, VocabParallelEmbedding) and name == "weight":
        return Split(0)
    return None


@register_split_rule
def _lora_rule(model, key, name):
    """LoRA ``matrix_A.i``/``matrix_B.i``: the layouts of :mod:`sat_patches.lora` (its
    ``split_lora_state_dict`` splits checkpoints the same way)."""
    if ".matrix_A." not in key and ".matrix_B." not in key:
        return None
    lora = sys.modules.get("sat_patches.lora")
    if lora is None:
        return None
    layer = model.get_submodule(key.rsplit(".matrix_", 1)[0])
    kind = getattr(layer, "kind", None) or lora.parallel_kind(layer.original)
    if ".matrix_A." in key:
        return Split(1) if kind == lora.ROW else "replicated"
    return Split(0) if kind == lora.COLUMN else "replicated"


def _pieces(split: Split, src_len: int, n_src: int, n_dst: int, rank: int) -> List[Tuple[int, int, int, int]]:
    """Rank ``rank`` of ``n_dst``'s slice of a tensor stored as ``n_src`` shards of ``src_len`` along
    the split dim: ``(dst_start, shard, src_start, length)`` pieces."""
    unit, rest = divmod(src_len, sum(split.blocks))
    if rest:
        raise ValueError(f"{src_len} does not split into blocks {split.blocks}")
    pieces, dst = [], 0
    src_offset = 0
    for b in split.blocks:
        per_shard = unit * b
        full = per_shard * n_src
        if full % n_dst:
            raise ValueError(f"a block of {full} does not split over {n_dst} ranks")
        want = full // n_dst
        x, end = rank * want, (rank + 1) * want
        while x < end:
            shard, local = divmod(x, per_shard)
            n = min(per_shard - local, end - x)
            pieces.append((dst, shard, src_offset + local, n))
            dst, x = dst + n, x + n
        src_offset += per_shard
    return pieces


# --------------------------------------------------------------------------------------
# Copying out of mapped files
# --------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_MADV_DONTNEED = 4


def release_pages(view: torch.Tensor) -> None:
    """Drop the pages of a memory-mapped checkpoint that ``view`` spans from this process's RSS (they
    are clean file pages: touched again, they are read again). Only for tensors of a mapped file."""
    if _libc is None or view.numel() == 0:
        return
    extent = sum((s - 1) * st for s, st in zip(view.shape, view.stride())) + 1
    start, end = view.data_ptr(), view.data_ptr() + extent * view.element_size()
    page = mmap.PAGESIZE
    start, end = start // page * page, -(-end // page) * page
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _copy(dst: torch.Tensor, src: torch.Tensor, mapped: bool) -> None:
    """``dst.copy_(src)`` in chunks along dim 0, releasing each chunk's mapped pages."""
    if src.dim() == 0 or src.numel() == 0:
        dst.copy_(src)
        return
    row = max(1, src[0].numel() * src.element_size())
    step = max(1, CHUNK_BYTES // row)
    for i in range(0, src.shape[0], step):
        chunk = src[i:i + step]
        dst[i:i + step].copy_(chunk)
        if mapped:
            release_pages(chunk)


class ShardedSource:
    """The ``module`` state dicts of a checkpoint's shards, mapped, as seen by one model-parallel rank."""

    def __init__(self, ckpt: Checkpoint, prefix: str = "", mp_rank: int = 0, mp_size: int = 1):
        self.ckpt, self.rank, self.size = ckpt, mp_rank, mp_size
        self.saved = [ckpt.open(i) for i in range(ckpt.mp_size)]
        for i, sd in enumerate(self.saved):
            if not isinstance(sd, dict) or not isinstance(sd.get("module"), dict):
                raise CheckpointError(f"'{ckpt.files[i]}' has no 'module' state dict: not a SAT checkpoint")
        self.state = [{k[len(prefix):]: v for k, v in sd["module"].items() if k.startswith(prefix)}
                      for sd in self.saved]
        self.used: set = set()
        self.mapped_storages = {t.untyped_storage().data_ptr() for sd in self.state for t in sd.values()
                                if isinstance(t, torch.Tensor)}

    @property
    def own(self) -> dict:
        """This rank's saved dict when the MP sizes match, else shard 0 (iteration, RNG states)."""
        return self.saved[self.rank if self.ckpt.mp_size == self.size else 0]

    def keys(self):
        return self.state[0].keys()

    def __contains__(self, key: str) -> bool:
        return key in self.state[0]

    def pieces(self, key: str, like: torch.Tensor, split) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(destination index view of like-shaped tensor, source view)`` pairs for this rank."""
        self.used.add(key)
        n_src = self.ckpt.mp_size
        srcs = [sd[key] for sd in self.state]
        if split is None:
            src = srcs[self.rank if n_src == self.size else 0]
            self._check(key, src.shape == like.shape, src, like, split)
            return [((), src)]
        d = split.dim
        same = all(s.shape[:d] + s.shape[d + 1:] == like.shape[:d] + like.shape[d + 1:] for s in srcs)
        self._check(key, same and srcs[0].shape[d] * n_src == like.shape[d] * self.size, srcs[0], like, split)
        out = []
        for dst, shard, start, n in _pieces(split, srcs[0].shape[d], n_src, self.size, self.rank):
            index = (slice(None),) * d + (slice(dst, dst + n),)
            out.append((index, srcs[shard].narrow(d, start, n)))
        return out

    def _check(self, key, ok, src, like, split):
        if ok:
            return
        if split is None and self.ckpt.mp_size != self.size:
            raise CheckpointError(
                f"'{key}' is {tuple(src.shape)} in the MP={self.ckpt.mp_size} checkpoint but "
                f"{tuple(like.shape)} at MP={self.size}, and sat_patches does not know how it is split: "
                f"merge the checkpoint to MP=1 first ({MERGE_COMMAND}), or load at MP={self.ckpt.mp_size}")
        raise CheckpointError(f"size mismatch for '{key}': {tuple(src.shape)} per shard in "
                              f"'{self.ckpt.path}' (MP={self.ckpt.mp_size}), {tuple(like.shape)} in the model "
                              f"at MP={self.size}: model_config.json and the checkpoint disagree")

    def copy_into(self, key: str, dst: torch.Tensor, split) -> None:
        with torch.no_grad():
            for index, src in self.pieces(key, dst, split):
                _copy(dst[index], src, mapped=True)

    def assembled(self, key: str, like: torch.Tensor, split) -> torch.Tensor:
        """This rank's slice as one CPU tensor (a view of the mapped file when it is one piece)."""
        parts = self.pieces(key, like, split)
        if len(parts) == 1 and parts[0][0] == ():
            return parts[0][1]
        out = torch.empty(like.shape, dtype=parts[0][1].dtype)
        for index, src in parts:
            out[index].copy_(src)
        return out


# --------------------------------------------------------------------------------------
# Loading a state into a model
# --------------------------------------------------------------------------------------

def materialise_device() -> torch.device:
    """Where tensors built on meta are materialised: the compute device (CPU while it is meta)."""
    return devices.communication_device()


def _hooked(module: torch.nn.Module) -> bool:
    """Modules with their own load logic (SAT/our LoRA layers, Hack* layers, pre-hooks)."""
    return (type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
            or bool(module._load_state_dict_pre_hooks))


def _tensors(module: torch.nn.Module):
    """(name, tensor, is_parameter, persistent) of a module's own parameters and buffers."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True, True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, False, name not in module._non_persistent_buffers_set


class _LazyState(Mapping):
    """What a module with its own ``_load_from_state_dict`` sees: this rank's slices, read on use."""

    def __init__(self, source: ShardedSource, resolve):
        self.source, self.resolve, self.views = source, resolve, []

    def __contains__(self, key):
        return key in self.source

    def __iter__(self):
        return iter(self.source.keys())

    def __len__(self):
        return len(self.source.keys())

    def __getitem__(self, key):
        like, split = self.resolve(key)
        if like is None:
            tensor = self.source.state[0][key]
        else:
            tensor = self.source.assembled(key, like, split)
        self.source.used.add(key)
        if tensor.untyped_storage().data_ptr() in self.source.mapped_storages:
            self.views.append(tensor)  # a view of the mapped file: its pages are released after use
        return tensor

    def release(self):
        for t in self.views:
            release_pages(t)
        self.views.clear()


def _resolve(model: torch.nn.Module, key: str):
    """(model tensor, split) for a state-dict key; SAT LoRA's plain ``x.weight`` is ``x.original.weight``."""
    path, _, name = key.rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        return None, None
    tensor = getattr(owner, name, None)
    if not isinstance(tensor, torch.Tensor) and isinstance(getattr(owner, "original", None), torch.nn.Module):
        owner, key = owner.original, f"{path}.original.{name}"
        tensor = getattr(owner, name, None)
    if not isinstance(tensor, torch.Tensor):
        return None, None
    return tensor, split_of(model, key, owner, name)


def load_state(model: torch.nn.Module, source: ShardedSource) -> Tuple[List[str], List[str]]:
    """Fill ``model`` from ``source`` like ``load_state_dict(strict=False)``: in place, or by assignment
    where a tensor is still on meta (attributes such as ``model_parallel`` are kept). Returns
    (missing_keys, unexpected_keys)."""
    missing, unexpected, errors = [], [], []
    assigned: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, its replacement)
    target = materialise_device()
    hooked_prefixes = []

    def fill(module, prefix):
        for name, t, is_param, persistent in _tensors(module):
            key = prefix + name
            if not persistent:
                continue
            if key not in source:
                missing.append(key)
                continue
            if id(t) in assigned and assigned[id(t)][0] is t:  # shared (tied) tensor, already loaded
                new = assigned[id(t)][1]
                source.used.add(key)
            elif t.is_meta:
                new = torch.empty(t.shape, dtype=t.dtype, device=target)
                source.copy_into(key, new, split_of(model, key, module, name))
                if is_param:
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    new.__dict__.update(t.__dict__)
                assigned[id(t)] = (t, new)  # holding t keeps its id from being reused
            else:
                source.copy_into(key, t, split_of(model, key, module, name))
                continue
            (module._parameters if is_param else module._buffers)[name] = new

    def load(module, prefix):
        if _hooked(module):
            hooked_prefixes.append(prefix)
            view = _LazyState(source, lambda key: _resolve(model, key))
            module._load_from_state_dict(view, prefix, {}, True, missing, unexpected, errors)
            view.release()
        else:
            fill(module, prefix)
        for child_name, child in module._modules.items():
            if child is not None:
                load(child, prefix + child_name + ".")
        incompatible = torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
        for hook in module._load_state_dict_post_hooks.values():
            hook(module, incompatible)

    load(model, "")
    if errors:
        raise CheckpointError("loading '{}' failed:\n\t{}".format(source.ckpt.path, "\n\t".join(errors)))
    unexpected += [k for k in source.keys() if k not in source.used and k not in unexpected
                   and not any(k.startswith(p) for p in hooked_prefixes if p)]
    return missing, unexpected


def meta_tensors(model: torch.nn.Module) -> List[str]:
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]


def _model_parallel() -> Tuple[int, int]:
    from sat import mpu
    if dist.is_initialized() and mpu.model_parallel_is_initialized():
        return mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    return 0, 1


def open_source(ckpt: Checkpoint, prefix: str = "") -> ShardedSource:
    """Map ``ckpt``'s shards for this rank's model-parallel rank and size."""
    rank, size = _model_parallel()
    with stage(f"opening {ckpt.mp_size} shard(s) of '{ckpt.path}' iteration {ckpt.iteration}"):
        return ShardedSource(ckpt, prefix, rank, size)


# --------------------------------------------------------------------------------------
# SAT entry points
# --------------------------------------------------------------------------------------

def load_checkpoint(model, args, load_path=None, prefix="", specific_iteration=None, *,
                    source: Optional[ShardedSource] = None, all_ranks: Optional[bool] = None):
    """SAT's ``load_checkpoint`` (same arguments, same return: the iteration to resume from), reading
    this rank's slices from mapped files at any model-parallel size. With ``all_ranks`` (every rank
    loads: ``from_pretrained``, ``training_main``) the ranks meet at a :func:`barrier` afterwards."""
    from sat.helpers import print_rank0
    source = source or open_source(find_checkpoint(load_path or args.load, specific_iteration), prefix)
    ckpt = source.ckpt
    mode = getattr(args, "mode", "inference")
    module = model.module if hasattr(model, "module") else model
    with stage(f"loading '{ckpt.path}' iteration {ckpt.iteration} (MP={ckpt.mp_size} -> MP={source.size})"):
        missing, unexpected = load_state(module, source)
    if unexpected:
        print_rank0(f"Will continue but found unexpected_keys! Check whether you are loading correct "
                    f"checkpoints: {unexpected}.")
    if missing:
        _handle_missing(module, args, mode, missing)
    left = meta_tensors(module)
    if left:
        raise CheckpointError(f"{left[:5]}{' ...' if len(left) > 5 else ''} are still on meta after loading "
                              f"'{ckpt.path}': the checkpoint lacks them; build the model on the compute "
                              f"device instead of meta, or load a checkpoint that has them")
    iteration = 0 if ckpt.release else ckpt.iteration
    if mode == "finetune":
        iteration = 0
    elif mode == "pretrain" and not getattr(args, "no_load_rng", False):
        _restore_rng(source.own)
    elif mode == "inference":
        module.eval()
    del source
    if _all_ranks_load if all_ranks is None else all_ranks:
        barrier(f"loaded '{ckpt.path}'")
    print_rank0(f"> loaded {ckpt.path} iteration {ckpt.iteration} (MP={ckpt.mp_size}) with sat_patches")
    return iteration


def _handle_missing(module, args, mode, missing):
    if mode == "inference":
        if getattr(args, "force_inference", False):
            warnings.warn(f"Missing keys for inference: {missing}.", SatPatchesWarning)
            return
        raise CheckpointError(f"Missing keys for inference: {missing}. Load the matching checkpoint, or "
                              f"pass --force_inference to run anyway.")
    if not getattr(args, "force_train", False):
        stray = [k for k in missing if "mixins" not in k and "cross_attention" not in k]
        if stray or mode != "finetune":
            raise CheckpointError(f"checkpoint lacks {stray or missing} (mode {mode}): only new mixins may be "
                                  f"missing, in --mode finetune; pass --force-train to train anyway")
    names = []
    for key in missing:
        parts = key.split(".")
        if "mixins" in parts and parts[parts.index("mixins") + 1] not in names:
            names.append(parts[parts.index("mixins") + 1])
    with construction.build_on(materialise_device(), construction.model_dtype(module)):
        module.reinit(names)


def _restore_rng(saved: dict) -> None:
    import random
    import numpy as np
    states = [("random_rng_state", random.setstate), ("np_rng_state", np.random.set_state),
              ("torch_rng_state", torch.set_rng_state)]
    if torch.cuda.is_available():
        states.append(("cuda_rng_state", torch.cuda.set_rng_state))
    absent = [name for name, _ in states if name not in saved]
    for name, setter in states:
        if name in saved:
            setter(saved[name])
    if absent:
        warnings.warn(f"checkpoint has no {', '.join(absent)} (saved with --no-save-rng?): those random "
                      f"states start fresh; pass --no-load-rng to silence this", SatPatchesWarning)


def _build(args, model_cls, kwargs, on_meta: bool):
    """Build like SAT's ``get_model``; on meta without initialising or moving anything."""
    from sat.model.base_model import get_model
    if not on_meta:
        return get_model(args, model_cls, **kwargs)
    from sat.helpers import print_rank0
    kwargs = dict(kwargs)
    dtype = construction.run_dtype(args, kwargs.pop("params_dtype", None))
    print_rank0(f"building {model_cls.__name__} model on meta, {dtype} ...")
    with construction.build_on("meta", dtype):
        model = model_cls(args, params_dtype=dtype, **kwargs)
    if getattr(args, "fp16", False):
        model.half()
    elif getattr(args, "bf16", False):
        model.bfloat16()
    return model


def fills_every_tensor(model: torch.nn.Module, keys: ShardedSource) -> bool:
    """Can ``model`` (built on meta) be materialised from a checkpoint with these keys alone?"""
    for prefix, module in model.named_modules():
        prefix = prefix + "." if prefix else ""
        for name, t, _, persistent in _tensors(module):
            if t.is_meta and (_hooked(module) or not persistent or prefix + name not in keys):
                return False
    return True


def build_and_load(model_cls, args, ckpt: Checkpoint, prefix: str = "", **kwargs):
    """Build ``model_cls(args)`` and load ``ckpt`` on every rank: on meta then materialised from the
    checkpoint when it holds every tensor, else on the compute device (initialised, as SAT's
    ``get_model``) then loaded into."""
    from sat.helpers import print_rank0
    source = open_source(ckpt, prefix)  # before building: a damaged file stops here
    with stage(f"building {model_cls.__name__} on meta"):
        model = _build(args, model_cls, kwargs, on_meta=True)
    if not fills_every_tensor(model, source):
        print_rank0(f"building {model_cls.__name__} on {devices.compute_device()}: the checkpoint does "
                    f"not hold every tensor of the model ({', '.join(meta_tensors(model)[:3])} ...)")
        model = None
    if model is None:
        with stage(f"building {model_cls.__name__} on {devices.compute_device()}"):
            model = _build(args, model_cls, kwargs, on_meta=False)
    load_checkpoint(model, args, prefix=prefix, source=source, all_ranks=True)
    return model.to(materialise_device())


def ensure_model_parallel(args) -> None:
    """torch.distributed and model-parallel groups of ``args.model_parallel_size``, before the model is
    built (SAT's ``BaseModel`` sets them up the same way; its ``from_pretrained`` re-creates them)."""
    from sat import mpu
    from sat.arguments import _simple_init
    size = getattr(args, "model_parallel_size", 1)
    if dist.is_initialized() and mpu.model_parallel_is_initialized() \
            and mpu.get_model_parallel_world_size() != size:
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(size)
    _simple_init(model_parallel_size=size, seed=getattr(args, "seed", 1234))


def from_pretrained(model_cls, name, args=None, *, home_path=None, url=None, prefix="", build_only=False,
                    use_node_group=True, overwrite_args=None, **kwargs):
    """SAT's ``from_pretrained`` at any ``model_parallel_size``; ``model_cls`` None means AutoModel.

    The caller's ``args`` and ``overwrite_args`` are left as they were; every rank builds and loads
    only its own partition; an MP=N checkpoint loads at MP=N or any other size.
    """
    from sat.arguments import overwrite_args_by_dict, reset_random_seed, update_args_with_file
    from sat.model.registry import model_registry
    from sat.resources import auto_create
    model_path = name if os.path.isdir(name) else auto_create(name, path=home_path, url=url)
    read_model_config(model_path, need_class=model_cls is None)
    specific_iteration = kwargs.pop("specific_iteration", None)
    ckpt = None if build_only else find_checkpoint(model_path, specific_iteration)
    overwrite = dict(overwrite_args or {})
    caller_mp = getattr(args, "model_parallel_size", 1)
    null_args = args is None
    if args is not None:
        args = copy.copy(args)  # update_args_with_file deletes the config's keys from the namespace it gets
    else:
        args = model_cls.get_args() if model_cls is not None else argparse.Namespace()
    args = update_args_with_file(args, path=os.path.join(model_path, "model_config.json"))
    args = overwrite_args_by_dict(args, overwrite_args=overwrite)
    if model_cls is None:
        model_cls = model_registry.get(args.model_class)
        if null_args:
            for k, v in vars(model_cls.get_args()).items():
                if not hasattr(args, k):
                    setattr(args, k, v)
    ensure_model_parallel(args)
    if build_only:
        return _build(args, model_cls, kwargs, on_meta=False), args
    model = build_and_load(model_cls, args, ckpt, prefix, **kwargs)
    new_mp = overwrite.get("model_parallel_size")
    if new_mp is not None and (new_mp != 1 or caller_mp == 1):
        reset_random_seed(6)  # as SAT's model-parallel branch does after splitting
    return model, args


# --------------------------------------------------------------------------------------
# Coordination: stages, barriers with a timeout, LOCAL_WORLD_SIZE, experiment_name
# --------------------------------------------------------------------------------------

_barriers = 0
_all_ranks_load = False  # True inside training_main: every rank calls load_checkpoint


@contextlib.contextmanager
def all_ranks_loading():
    """Inside the block every rank calls ``load_checkpoint`` (SAT's ``training_main``)."""
    global _all_ranks_load
    previous, _all_ranks_load = _all_ranks_load, True
    try:
        yield
    finally:
        _all_ranks_load = previous


def _store():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


@contextlib.contextmanager
def stage(name: str):
    """Announce what this rank is doing (``with stage("reading ...")``) so that a rank waiting at a
    :func:`barrier` can say where the late ones are."""
    store = _store()
    if store is not None:
        store.set(f"sat_patches/stage/{dist.get_rank()}", f"{time.time()}|{name}")
    yield


def barrier(name: str, timeout: Optional[float] = None) -> None:
    """Wait until every rank reached this point, at most ``timeout`` seconds (default
    ``SAT_PATCHES_LOAD_TIMEOUT``); then raise :class:`LoadTimeout` naming each late rank's stage."""
    global _barriers
    store = _store()
    if store is None:
        return
    timeout = load_timeout() if timeout is None else timeout
    _barriers += 1
    me, world = dist.get_rank(), dist.get_world_size()
    key = f"sat_patches/barrier/{_barriers}/"
    with stage(f"waiting at '{name}'"):
        store.set(key + str(me), "1")
    _wait(store, [key + str(r) for r in range(world)], timeout, name)
    store.set(key + f"left/{me}", "1")
    if me == 0:  # rank 0 usually hosts the store: it leaves last, so no rank loses the store while waiting
        _wait(store, [key + f"left/{r}" for r in range(world)], timeout, name)


def _wait(store, keys: List[str], timeout: float, name: str) -> None:
    me = dist.get_rank()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except dist.DistNetworkError as exc:
        raise RuntimeError(f"rank {me} lost the process group's store at '{name}': the rank that hosts it "
                           f"(usually rank 0) exited or crashed; see that rank's log") from exc
    except (dist.DistError, RuntimeError) as exc:
        late = [r for r, k in enumerate(keys) if not store.check([k])]
        raise LoadTimeout(f"rank {me} waited {timeout:.0f} s at '{name}' for rank(s) {late}: "
                          + "; ".join(_stage_of(store, r) for r in late)
                          + f". Look at those ranks (hung, or slower storage), or raise SAT_PATCHES_LOAD_TIMEOUT "
                            f"(now {timeout:.0f} s).") from exc


def _stage_of(store, rank: int) -> str:
    key = f"sat_patches/stage/{rank}"
    if not store.check([key]):
        return f"rank {rank} has not started loading"
    since, _, what = store.get(key).decode().partition("|")
    return f"rank {rank} is at stage '{what}' for {time.time() - float(since):.0f} s"


def store_gather(name: str, value: str, timeout: Optional[float] = None) -> List[str]:
    """Every rank's ``value`` (rank order), exchanged through the process group's store: no tensors,
    so it works whatever backend the group has (an NCCL-only group on a rank without CUDA, too)."""
    store = _store()
    if store is None:
        return [value]
    key = f"sat_patches/{name}/"
    store.set(key + str(dist.get_rank()), value)
    keys = [key + str(r) for r in range(dist.get_world_size())]
    store.wait(keys, datetime.timedelta(seconds=load_timeout() if timeout is None else timeout))
    return [store.get(k).decode() for k in keys]


_node_ranks: Dict[Tuple[int, int], List[int]] = {}


def node_ranks() -> List[int]:
    """Global ranks on this rank's node (same host and launcher node rank), from every rank."""
    me = (dist.get_rank(), dist.get_world_size())
    if me not in _node_ranks:
        node = "|".join((socket.gethostname(), os.environ.get("GROUP_RANK") or os.environ.get("CROSS_RANK")
                         or os.environ.get("NODE_RANK") or ""))
        nodes = store_gather("node", node)
        _node_ranks[me] = [r for r, n in enumerate(nodes) if n == node]
    return _node_ranks[me]


def check_local_world_size() -> Optional[int]:
    """Set ``LOCAL_WORLD_SIZE`` to the number of ranks really on this node, with a warning when the
    environment says otherwise (SAT builds its node groups from it). Returns the size it checked."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = node_ranks()
    real, said = len(ranks), os.environ.get("LOCAL_WORLD_SIZE")
    world = dist.get_world_size()
    contiguous = ranks == list(range(ranks[0], ranks[0] + real)) and ranks[0] % real == 0 and world % real == 0
    if not contiguous:
        warnings.warn(f"ranks {ranks} share this node: SAT's node groups assume consecutive blocks of "
                      f"LOCAL_WORLD_SIZE ranks per node; leaving LOCAL_WORLD_SIZE={said}", SatPatchesWarning)
        return None
    if said is None:  # SAT would guess min(world size, 8)
        os.environ["LOCAL_WORLD_SIZE"] = str(real)
    elif said != str(real):
        warnings.warn(f"LOCAL_WORLD_SIZE={said} but this node runs {real} rank(s) {ranks} (a launcher "
                      f"environment such as CogVLM's .deepspeed_env sets it): using LOCAL_WORLD_SIZE={real} "
                      f"for SAT's node groups", SatPatchesWarning)
        os.environ["LOCAL_WORLD_SIZE"] = str(real)
    return real


class _SharedStart:
    """Stands in for ``datetime`` in SAT's training module until its first ``now()`` (the
    ``experiment_name`` timestamp), which returns rank 0's time; then puts ``datetime`` back."""

    def __init__(self, module, real, shared):
        self._module, self._real, self._shared = module, real, shared

    def now(self, tz=None):
        self._module.datetime = self._real
        return self._shared

    def __getattr__(self, name):
        return getattr(self._real, name)


# --------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------

def _load_checkpoint(original):
    """SAT's load_checkpoint, mapped and rank-local; ZeRO-3 models keep SAT's own path."""
    @functools.wraps(original)
    def wrapper(model, args, load_path=None, prefix="", specific_iteration=None):
        from sat.helpers import check_if_zero3
        if check_if_zero3(args):
            return original(model, args, load_path=load_path, prefix=prefix, specific_iteration=specific_iteration)
        return load_checkpoint(model, args, load_path, prefix, specific_iteration)
    return wrapper


def _from_pretrained(auto: bool):
    """SAT's from_pretrained, rank-local at any MP size; under ZeRO-3 SAT's own (zero.Init places weights)."""
    def make(original):
        @functools.wraps(original.__func__)
        def wrapper(cls, name, args=None, **kwargs):
            from sat.helpers import check_if_zero3
            if args is not None and check_if_zero3(args):
                return original.__func__(cls, name, args, **kwargs)
            return from_pretrained(None if auto else cls, name, args, **kwargs)
        return classmethod(wrapper)
    return make


def _initialize_model_parallel(original):
    @functools.wraps(original)
    def initialize_model_parallel(model_parallel_size_):
        check_local_world_size()
        return original(model_parallel_size_)
    return initialize_model_parallel


_runs = 0


def _training_main(original):
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def training_main(args, *a, **kw):
        timestamped = not (args.load and args.mode == "pretrain")
        global _runs
        clock = module.datetime
        if timestamped and _store() is not None:
            _runs += 1
            start = clock.now().isoformat() if dist.get_rank() == 0 else ""
            start = store_gather(f"start/{_runs}", start)[0]
            module.datetime = _SharedStart(module, clock, clock.fromisoformat(start))
        try:
            with all_ranks_loading():
                return original(args, *a, **kw)
        finally:
            module.datetime = clock
    return training_main


def _expect_from_pretrained(original):
    return expect_names("mp_split_model_rank0", "from_pretrained_base")(original) or \
        expect_params("overwrite_args", "use_node_group")(original)


PATCHES = [
    Patch("load_checkpoint_mmap", "sat.training.model_io:load_checkpoint", _load_checkpoint,
          answers="CogVLM 283/320/162: every rank torch.loads the whole checkpoint into RAM (no mmap); "
                  "MP=N checkpoints load only at MP=N",
          expect=expect_names("get_checkpoint_name", "load_state_dict", "reinit")),
    Patch("from_pretrained_rank_local", "sat.model.base_model:BaseModel.from_pretrained", _from_pretrained(False),
          answers="SAT 173 / CogVLM 162, 233: MP>1 from_pretrained builds the full model on node rank 0 and "
                  "sends partitions (.cuda()); MP=N to MP=N raises 'model_parallel_size is inconsistent'; "
                  "mutates the caller's args",
          expect=_expect_from_pretrained),
    Patch("automodel_from_pretrained_rank_local", "sat.model.base_model:AutoModel.from_pretrained",
          _from_pretrained(True),
          answers="SAT 173 / CogVLM 233: AutoModel.from_pretrained, same model-parallel path as BaseModel's",
          expect=_expect_from_pretrained),
    Patch("local_world_size_check", "sat.mpu.initialize:initialize_model_parallel", _initialize_model_parallel,
          answers="SAT 173 / CogVLM finetune_demo: LOCAL_WORLD_SIZE=8 from .deepspeed_env on a 2-GPU box "
                  "leaves SAT's node groups empty ('node group is not initialized')",
          expect=expect_names("environ", "_NODE_GROUP", "new_group")),
    Patch("shared_experiment_name", "sat.training.deepspeed_training:training_main", _training_main,
          answers="CogVLM 269: experiment_name timestamps differ per rank, one MP run saves into two directories",
          expect=expect_names("experiment_name", "datetime", "strftime")),
]
