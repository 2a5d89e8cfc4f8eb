"""Which tensors are a memory-mapped file's own pages, and what this process's mappings of a file
hold, read from ``/proc/self/maps`` and ``/proc/self/smaps`` (Linux): for tests of zero-copy loading."""
from __future__ import annotations

import os
from typing import Iterable, List, Tuple

import torch


def _mappings(path: str):
    """(start, end, smaps lines) of each of this process's mappings of ``path``."""
    target, current = os.path.realpath(path), None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                if current is not None:
                    yield current
                start, end = (int(x, 16) for x in fields[0].split("-"))
                current = (start, end, []) if len(fields) >= 6 and fields[5] == target else None
            elif current is not None:
                current[2].append(line)
    if current is not None:
        yield current


def mapped_spans(path: str) -> List[Tuple[int, int]]:
    """(start, end) addresses of this process's mappings of ``path``."""
    return [(start, end) for start, end, _ in _mappings(path)]


def in_file(tensor: torch.Tensor, path: str) -> bool:
    """Is ``tensor``'s memory inside a mapping of ``path`` (the file's pages, not a copy)?"""
    address = tensor.untyped_storage().data_ptr()
    return any(start <= address < end for start, end in mapped_spans(path))


def smaps_bytes(path: str, field: str, holding: Iterable[torch.Tensor] = ()) -> int:
    """``field`` (``Rss``, ``Pss``, ``Anonymous`` ...) summed over this process's mappings of ``path``
    (only those that hold one of the ``holding`` tensors, when given), in bytes."""
    addresses = [t.untyped_storage().data_ptr() for t in holding]
    total = 0
    for start, end, lines in _mappings(path):
        if addresses and not any(start <= a < end for a in addresses):
            continue
        for line in lines:
            if line.startswith(field + ":"):
                total += int(line.split()[1]) * 1024
    return total


def first_read(tensors: Iterable[torch.Tensor]) -> None:
    """Read every byte of every tensor once (the largest byte: memory speed), so that pages a load did not
    touch (a lent tensor's file pages) fault in now."""
    for t in tensors:
        if t.numel():
            t.detach().reshape(-1).view(torch.uint8).max()
