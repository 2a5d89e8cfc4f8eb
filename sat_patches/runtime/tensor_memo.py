"""Facts about a batch's tensors worked out once per step, not in every layer (each answer a host sync).

:class:`TensorMemo` remembers an answer per tensor, keyed by its storage (held weakly: an entry goes with its
memory; a detached copy shares it) and its view and version counter (any in-place write bumps it).
"""
from __future__ import annotations

import weakref
from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


class TensorMemo(Generic[T]):
    """``memo(tensor)`` is ``compute(tensor)``, computed once for each tensor's values (see the module)."""

    def __init__(self, compute: Callable[[torch.Tensor], T]):
        self.compute = compute
        self._entries: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # storage -> (view key, value)
        self.computed = 0  # how many times ``compute`` ran (the tests count host syncs with it)

    def __call__(self, tensor: torch.Tensor) -> T:
        storage = tensor.untyped_storage()
        # what, beside the storage, tells two tensors' values apart
        key = (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor._version)
        entry = self._entries.get(storage)
        if entry is not None and entry[0] == key:
            return entry[1]
        value = self.compute(tensor)
        self.computed += 1
        self._entries[storage] = (key, value)
        return value
