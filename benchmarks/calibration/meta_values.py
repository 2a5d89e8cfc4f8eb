"""Run a real model on meta tensors when its code looks at the values of small inputs.

A model's forward can branch on, or index with, values that do not depend on its weights: SAT's
``attention_fn_default`` checks whether the mask is causal or full (``.all()``), CogVLM routes the
image tokens of ``vision_expert_mask`` to the vision experts (boolean indexing), its image mixin
counts the slots of ``image_embed_mask``, sat_patches' routing copies the mask to the host once. On meta tensors each of these fails ("Tensor.item() cannot
be called on meta tensors", data-dependent output shapes).

Inside :class:`MetaValues`, a meta tensor made by :meth:`MetaValues.meta` carries its values: a CPU
copy (the *shadow*). Every operation whose tensor inputs are all shadowed (or CPU) computes its
shadow on the CPU too, as long as the result is small (masks, positions, token ids; never a
weight-sized tensor), so ``.item()``/``bool()`` and a copy to the CPU read the shadow, and indexing with a shadowed
index uses the shadow's values. Everything else runs on meta as usual, so a layer at full width
costs no memory and takes milliseconds.

    with MetaValues() as values, LiveBytes() as counter:
        mask = values.meta(cpu_mask)
        model(..., vision_expert_mask=mask, ...)
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from live_bytes import tensors_in

SHADOW_LIMIT = 64 * 2 ** 20
"""Largest result (bytes) whose values are kept: far above any mask, far below any activation at full size."""

aten = torch.ops.aten
# operations whose output shape depends on the values of an index: run with the index's shadow
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
             aten.nonzero.default, aten.masked_select.default}


class MetaValues(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._shadows = WeakTensorKeyDictionary()  # meta tensor -> its values on the CPU

    def meta(self, value: torch.Tensor) -> torch.Tensor:
        """A meta tensor like ``value`` (a CPU tensor) that keeps ``value`` as its shadow."""
        out = torch.empty_like(value, device="meta")
        self._shadows[out] = value.detach().clone()
        return out

    def shadow(self, t: torch.Tensor):
        return t if t.device.type == "cpu" else self._shadows.get(t)

    def _on_cpu(self, value):
        if isinstance(value, torch.Tensor):
            return self.shadow(value)
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        shadowed = bool(tensors) and all(self.shadow(t) is not None for t in tensors)
        if func is aten._local_scalar_dense.default and shadowed:
            return self.shadow(args[0]).item()
        if func is aten._to_copy.default and shadowed and torch.device(kwargs.get("device") or "meta").type == "cpu":
            return self.shadow(args[0]).to(dtype=kwargs.get("dtype"), copy=True)  # a read into host memory
        if func in _INDEXING:  # the indexed tensor stays meta; the index takes its values
            args, kwargs = tree_map(lambda v: self._index_values(v), (args, kwargs))
        out = func(*args, **kwargs)
        if shadowed and all(t.device.type == "meta" for t in tensors_in(out)):
            self._shadow_result(func, args, kwargs, out)
        return out

    def _index_values(self, value):
        if isinstance(value, torch.Tensor) and value.device.type == "meta" and \
                (value.dtype == torch.bool or not value.is_floating_point()) and value in self._shadows:
            return self._shadows[value]
        return value

    def _shadow_result(self, func, args, kwargs, out) -> None:
        outs = tensors_in(out)
        if not outs or sum(t.numel() * t.element_size() for t in outs) > SHADOW_LIMIT:
            return
        cpu_args, cpu_kwargs = tree_map(self._on_cpu, (args, kwargs))
        cpu_outs = tensors_in(func(*cpu_args, **cpu_kwargs))
        for meta_out, cpu_out in zip(outs, cpu_outs):
            self._shadows[meta_out] = cpu_out
