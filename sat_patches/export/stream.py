"""safetensors files written one tensor at a time (the header, which needs only shapes and dtypes, first:
host memory holds one tensor, never the file), and read through a private memory mapping.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Callable, List, Sequence, Tuple

import torch

from .source import ExportError

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def write_safetensors(path: str, plan: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
                      produce: Callable[[str], torch.Tensor], done: Callable[[torch.Tensor], None] = lambda t: None) -> int:
    """Write ``plan`` (``(name, shape, dtype)`` in file order) to ``path``: ``produce(name)`` gives each
    tensor when its turn comes (checked against the plan), ``done(tensor)`` runs after its bytes are
    written. Returns the bytes of tensor data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in plan:
        size = nbytes(shape, dtype)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype in plan:
            t = produce(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(t.shape)} {t.dtype}, planned {tuple(shape)} {dtype}")
            flat = t.detach().contiguous().reshape(-1)
            if flat.numel():
                f.write(memoryview(flat.view(torch.uint8).numpy()))
            done(t)
            del t, flat
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return offset


def shard_plan(items: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]], max_bytes: int) -> List[list]:
    """``items`` cut into consecutive shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: List[list] = [[]]
    size = 0
    for item in items:
        n = nbytes(item[1], item[2])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


_FROM_NAME = {v: k for k, v in DTYPES.items()}


def read_header(path: str) -> dict:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets), checked for truncation."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ExportError(f"'{path}' is empty or truncated: copy or download it again")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ExportError(f"'{path}' is truncated (header of {length} bytes in a file of {size}): copy or "
                              f"download it again")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ExportError(f"'{path}' is not a safetensors file ({exc})") from exc
    end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] or [0])
    if 8 + length + end > size:
        raise ExportError(f"'{path}' is truncated ({size} bytes, its header names {8 + length + end}): copy or "
                          f"download it again")
    header["__data_start__"] = 8 + length
    return header


def mapped_tensors(path: str, header: dict) -> dict:
    """The tensors of a safetensors file as views of a private memory mapping (nothing read until used)."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    start, out = header["__data_start__"], {}
    for name, info in header.items():
        if name.startswith("__"):
            continue
        dtype = _FROM_NAME.get(info["dtype"])
        if dtype is None:
            raise ExportError(f"'{path}': {name} has dtype {info['dtype']}, which is not a weight dtype here")
        begin, end = info["data_offsets"]
        count = (end - begin) // dtype.itemsize
        t = torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin) if count else \
            torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out
