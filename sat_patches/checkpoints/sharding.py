"""How checkpoint tensors are split across model-parallel ranks, and copied out of mapped shard files.

Checkpoint files are opened with ``torch.load(mmap=True)``. Each rank reads only its own slice of each
split tensor (Column/Row/VocabParallel, ColumnParallel ``stride`` blocks of a fused QKV, LoRA A/B by
:func:`lora_factor_split`), in chunks of at most :data:`CHUNK_BYTES` whose mapped pages are released after
they are copied, so any model-parallel size loads from any other. On the CPU a tensor used whole, in the
model's dtype, is not copied: the parameter is the mapped file's (``SAT_PATCHES_LOAD_ZERO_COPY=0`` copies).
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from sat.mpu import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from ..core import settings
from .files import Checkpoint, CheckpointError
from .lora_names import FACTOR_A, FACTOR_B, factor_key

CHUNK_BYTES = int(settings.read("SAT_PATCHES_LOAD_CHUNK_MB") * 2**20)
"""Largest piece of a checkpoint tensor read at once (``SAT_PATCHES_LOAD_CHUNK_MB``, default 64)."""
MERGE_COMMAND = "python -m sat_patches merge"


@dataclass(frozen=True)
class Split:
    """A tensor split along ``dim``; ``blocks`` are the relative sizes of stacked parts that are each
    split evenly (ColumnParallel ``stride``: Q, K, V of a fused QKV), ``(1,)`` for a plain split."""
    dim: int
    blocks: Tuple[int, ...] = (1,)


def split_of(model: torch.nn.Module, key: str, owner: torch.nn.Module, name: str):
    """The :class:`Split` of ``owner.<name>`` (state-dict ``key``), or None when every rank holds it whole."""
    factor = factor_key(key)
    if factor is not None:  # LoRA's matrix_A.i/matrix_B.i: by their layer's base
        layer = model.get_submodule(factor.layer)
        return lora_factor_split(getattr(layer, "kind", None) or parallel_kind(layer.original), factor.factor)
    if isinstance(owner, ColumnParallelLinear) and name in ("weight", "bias"):
        stride = owner.stride
        return Split(0, (1,) * stride if isinstance(stride, int) else tuple(stride))
    if isinstance(owner, RowParallelLinear) and name == "weight":
        return Split(1)
    if isinstance(owner, VocabParallelEmbedding) and name == "weight":
        return Split(0)
    return None


COLUMN, ROW, PLAIN = "column", "row", "plain"
"""A linear layer's model-parallel type: ColumnParallelLinear (output rows split), RowParallelLinear
(input columns split), anything else (whole on every rank)."""


def parallel_kind(layer: torch.nn.Module) -> str:
    if isinstance(layer, ColumnParallelLinear):
        return COLUMN
    if isinstance(layer, RowParallelLinear):
        return ROW
    return PLAIN


def lora_factor_split(kind: str, factor: str) -> Optional[Split]:
    """How LoRA's ``factor`` of a layer whose base is of parallel ``kind`` is split across model-parallel ranks
    (None: whole on every rank). A (r x in) follows the base's input: split by columns under a row-parallel
    base; B (out x r) its output: split by rows under a column-parallel base."""
    if factor == FACTOR_A:
        return Split(1) if kind == ROW else None
    if factor == FACTOR_B:
        return Split(0) if kind == COLUMN else None
    raise ValueError(f"LoRA factor must be {FACTOR_A!r} or {FACTOR_B!r}, not {factor!r}")


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


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_MADV_DONTNEED = 4


def release_pages(view: torch.Tensor) -> None:
    """Drop the pages of a memory-mapped checkpoint that lie wholly inside ``view``'s bytes from this
    process's RSS (they are clean file pages: touched again, they are read again). A page shared with
    a neighbouring tensor stays: that tensor may be a parameter now (:meth:`ShardedSource.materialised`).
    Only for tensors of a mapped file."""
    if _libc is None or view.numel() == 0:
        return
    extent = sum((s - 1) * st for s, st in zip(view.shape, view.stride())) + 1
    page = mmap.PAGESIZE
    start = -(-view.data_ptr() // page) * page
    end = (view.data_ptr() + extent * view.element_size()) // page * page
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _copy(dst: torch.Tensor, src: torch.Tensor, release: Callable[[torch.Tensor], None]) -> None:
    """``dst.copy_(src)`` in chunks along dim 0, ``release`` of each chunk after it is copied."""
    if src.dim() == 0 or src.numel() == 0:
        dst.copy_(src)
        return
    row = max(1, src[0].numel() * src.element_size())
    step = max(1, CHUNK_BYTES // row)
    for i in range(0, src.shape[0], step):
        chunk = src[i:i + step]
        dst[i:i + step].copy_(chunk)
        release(chunk)


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
        self.lending = settings.read("SAT_PATCHES_LOAD_ZERO_COPY")
        self.lent: set = set()  # mapped storages a tensor of the model now is: their pages are never released

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
        if split is None or n_src == self.size:  # replicated, or this rank's own shard: a saved tensor, whole
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

    def copy_into(self, key: str, dst: torch.Tensor, split, parts=None) -> None:
        """Copy this rank's slice of ``key`` (its :meth:`pieces`, unless given) into ``dst`` (converted to its
        dtype), a chunk at a time, releasing the mapped pages of each chunk copied."""
        with torch.no_grad():
            for index, src in parts or self.pieces(key, dst, split):
                _copy(dst[index], src, self.release)

    def release(self, view: torch.Tensor) -> None:
        """:func:`release_pages` of a mapped ``view`` whose storage is not lent to the model."""
        if view.untyped_storage().data_ptr() not in self.lent:
            release_pages(view)

    def materialised(self, key: str, like: torch.Tensor, split, device: torch.device,
                     lend: bool = True) -> torch.Tensor:
        """This rank's slice of ``key`` as a tensor of ``like``'s shape and dtype on ``device``: lent
        where it can be (:meth:`_lendable`), else new memory filled a chunk at a time.

        A lent tensor IS the mapped file's (mapped ``MAP_PRIVATE`` by :func:`.safe_load.load`: a write makes
        private copy-on-write pages, the file never changes); ranks on one node share its pages."""
        parts = self.pieces(key, like, split)
        if lend and self._lendable(parts, like, device):
            src = parts[0][1]
            self.lent.add(src.untyped_storage().data_ptr())
            return src.detach()
        out = torch.empty(like.shape, dtype=like.dtype, device=device)
        self.copy_into(key, out, split, parts)
        return out

    def _lendable(self, parts, like: torch.Tensor, device: torch.device) -> bool:
        """Can the model's tensor be the mapped one: zero copy on, the CPU, one whole saved tensor of ``like``'s
        dtype, contiguous, in a storage not lent yet (two parameters must not alias)."""
        if not (self.lending and device.type == "cpu" and len(parts) == 1 and parts[0][0] == ()):
            return False
        src = parts[0][1]
        storage = src.untyped_storage().data_ptr()
        return (src.dtype == like.dtype and src.is_contiguous() and storage in self.mapped_storages
                and storage not in self.lent)

    def assembled(self, key: str, like: torch.Tensor, split) -> torch.Tensor:
        """This rank's slice as one CPU tensor (a view of the mapped file when it is one piece)."""
        parts = self.pieces(key, like, split)
        if len(parts) == 1 and parts[0][0] == ():
            return parts[0][1]
        out = torch.empty(like.shape, dtype=parts[0][1].dtype)
        for index, src in parts:
            out[index].copy_(src)
        return out
