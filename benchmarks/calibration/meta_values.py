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

Most of those milliseconds are torch's meta kernels, many written in Python (``torch/_refs``, ``torch/_prims``);
every layer of a kind repeats the same operations on the same shapes. An operation that returns new tensors (no
view, no in-place write) on meta inputs alone is run once for each set of input shapes, strides, dtypes and other
arguments: after that its outputs are new empty meta tensors of the sizes, strides and dtypes it gave
(:meth:`MetaValues._meta_call`; ``remember_outputs=False`` runs every kernel).

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


def _fresh_outputs(func) -> bool:
    """Whether ``func`` returns only new tensors: no output aliases an input (views, in-place and ``out=``
    operations do), and each output is one tensor."""
    schema = func._schema
    return not schema.is_mutable and bool(schema.returns) and \
        all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)


def _signature(value):
    """A hashable stand-in for an operation's argument: what its meta kernel reads of a tensor (shape, strides,
    storage offset, dtype, device) and any other argument itself."""
    if isinstance(value, torch.Tensor):
        return value.device.type, value.dtype, tuple(value.shape), value.stride(), value.storage_offset()
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return dict, tuple((k, _signature(v)) for k, v in value.items())
    return type(value), value


class MetaValues(TorchDispatchMode):
    def __init__(self, remember_outputs: bool = True):
        super().__init__()
        self._shadows = WeakTensorKeyDictionary()  # meta tensor -> its values on the CPU
        self._remember = remember_outputs
        self._fresh = {}    # operation -> whether it returns only new tensors
        self._outputs = {}  # (operation, argument signature) -> its outputs' (size, stride, dtype), or None

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
        remembered = self._remember and not shadowed and func not in _INDEXING  # (so args are still those of tensors)
        out = self._meta_call(func, args, kwargs, tensors) if remembered else func(*args, **kwargs)
        if shadowed and all(t.device.type == "meta" for t in tensors_in(out)):
            self._shadow_result(func, args, kwargs, out)
        return out

    def _meta_call(self, func, args, kwargs, tensors):
        """``func(*args, **kwargs)``; when it returns only new tensors from meta inputs, its meta kernel runs once per
        signature of the arguments and later calls get new empty tensors of the same sizes, strides and dtypes (a
        meta kernel sees no values: what it returns follows from the signature). ``tensors``: those of the arguments."""
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = _fresh_outputs(func)
        if not (fresh and tensors and all(t.device.type == "meta" for t in tensors)):
            return func(*args, **kwargs)
        try:
            key = func, _signature(args), _signature(kwargs)
            known = self._outputs.get(key, False)
        except TypeError:  # an argument that cannot be hashed
            return func(*args, **kwargs)
        if known is None:
            return func(*args, **kwargs)
        if known:
            outs = [torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in known]
            return outs[0] if len(outs) == 1 else tuple(outs)
        out = func(*args, **kwargs)
        self._outputs[key] = self._layout(out)
        return out

    @staticmethod
    def _layout(out):
        """Each output's (size, stride, dtype) when new empty tensors of those reproduce it (a meta tensor whose
        storage is all the bytes its strides reach, from offset 0), else None."""
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        layout = []
        for t in outs:
            if not isinstance(t, torch.Tensor) or t.device.type != "meta" or t.storage_offset() != 0:
                return None
            size, stride = tuple(t.shape), t.stride()
            twin = torch.empty_strided(size, stride, dtype=t.dtype, device="meta")
            if twin.untyped_storage().nbytes() != t.untyped_storage().nbytes():
                return None
            layout.append((size, stride, t.dtype))
        return tuple(layout)

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
