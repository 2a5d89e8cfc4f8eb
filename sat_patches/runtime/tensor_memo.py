"""Facts about a batch's tensors worked out once per step, not in every layer.

A layer that asks a question of a mask with a Python ``if`` (is it causal? where are the image tokens?)
waits for the GPU to answer: a host sync per layer, and again in every layer recomputed under activation
checkpointing. The answer depends only on the tensor's values, which do not change while the step runs,
so :class:`TensorMemo` remembers it per tensor, keyed by

* its storage's Python object, which torch keeps for exactly as long as the memory lives (a detached
  copy, as activation checkpointing hands to the recomputed layers, shares it), held weakly: the memo
  keeps no tensor alive, and an entry goes with its memory, so a later tensor at the same address is
  never mistaken for it;
* its view (offset, shape, stride, dtype) and its version counter, which any in-place write bumps.

One entry per storage (the latest view asked about): a step asks each memo about one mask.
"""
from __future__ import annotations

import weakref
from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


def view_key(tensor: torch.Tensor) -> tuple:
    """What, beside the storage, tells two tensors' values apart."""
    return (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor._version)


class TensorMemo(Generic[T]):
    """``memo(tensor)`` is ``compute(tensor)``, computed once for each tensor's values (see the module)."""

    def __init__(self, compute: Callable[[torch.Tensor], T]):
        self.compute = compute
        self._entries: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # storage -> (view key, value)
        self.computed = 0  # how many times ``compute`` ran (the tests count host syncs with it)

    def __call__(self, tensor: torch.Tensor) -> T:
        storage, key = tensor.untyped_storage(), view_key(tensor)
        entry = self._entries.get(storage)
        if entry is not None and entry[0] == key:
            return entry[1]
        value = self.compute(tensor)
        self.computed += 1
        self._entries[storage] = (key, value)
        return value

    def clear(self) -> None:
        self._entries.clear()
