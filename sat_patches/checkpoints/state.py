"""Loading a checkpoint's state into a model: in place, or by assignment where the model is still on
meta, each rank reading only its own slices of the memory-mapped shards
(:class:`~sat_patches.checkpoints.sharding.ShardedSource`); and the random states a checkpoint saved.
"""
from __future__ import annotations

import os
import random
import warnings
import weakref
from collections.abc import Mapping
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist
from sat import mpu

from ..core.coordination import stage
from ..core.registry import SatPatchesWarning
from ..runtime import devices
from .files import Checkpoint, CheckpointError
from .lora_names import FACTORS, factor_key
from .sharding import ShardedSource, split_of


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
            self.source.release(t)
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


def load_state(model: torch.nn.Module, source: ShardedSource, after=None,
               lend=True) -> Tuple[List[str], List[str]]:
    """Fill ``model`` from ``source`` like ``load_state_dict(strict=False)``: in place, or by assignment where a
    tensor is still on meta, lent from the mapped file where ``lend`` (or ``lend(module)``) allows
    (:meth:`ShardedSource.materialised`). ``after(module, prefix)`` runs as each module is complete.
    Returns (missing_keys, unexpected_keys)."""
    missing, unexpected, errors = [], [], []
    # id(meta tensor) -> (it, its replacement): shared (tied) tensors are loaded once. The replacement
    # by weak reference: a layer converted as it is loaded (QLoRA's NF4) frees its float weights at once
    assigned: Dict[int, Tuple[torch.Tensor, "weakref.ref"]] = {}
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
            loaded = assigned[id(t)][1]() if id(t) in assigned and assigned[id(t)][0] is t else None
            if loaded is not None:  # shared (tied) tensor, already loaded
                new = loaded
                source.used.add(key)
            elif t.is_meta:
                lent = lend(module) if callable(lend) else lend
                new = source.materialised(key, t, split_of(model, key, module, name), target, lent)
                if is_param:
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    new.__dict__.update(t.__dict__)
                assigned[id(t)] = (t, weakref.ref(new))  # holding t keeps its id from being reused
            else:
                source.copy_into(key, t, split_of(model, key, module, name))
                continue
            (module._parameters if is_param else module._buffers)[name] = new

    def load(module, prefix):
        base = getattr(module, "original", None)
        if isinstance(base, torch.nn.Module) and prefix + "original." not in prefixes \
                and any(prefix + name in source for name, *_ in _tensors(base)):
            # a LoRA layer its model's constructor added, over a checkpoint saved without LoRA: the base
            # layer's tensors are the plain layer's keys; A and B keep their initialisation (as SAT's)
            fill(base, prefix)
            if after is not None:
                after(base, prefix + "original.")
            _materialise_lora_factors(module, target)
            if after is not None:
                after(module, prefix)
            return
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
        if after is not None:
            after(module, prefix)

    # every "a.b." that prefixes a key of the source (a LoRA layer saved with LoRA has "x.original.")
    prefixes = {key[:i + 1] for key in source.keys() for i, c in enumerate(key) if c == "."}
    load(model, "")
    if errors:
        raise CheckpointError("loading '{}' failed:\n\t{}".format(source.ckpt.path, "\n\t".join(errors)))
    unexpected += [k for k in source.keys() if k not in source.used and k not in unexpected
                   and not any(k.startswith(p) for p in hooked_prefixes if p)]
    return missing, unexpected


def _materialise_lora_factors(layer: torch.nn.Module, device: torch.device) -> None:
    """A LoRA layer built on meta (over a checkpoint without LoRA): its A and B on ``device``, initialised."""
    made = False
    for factor in FACTORS:
        factors = getattr(layer, factor, None) or []
        for i, p in enumerate(factors):
            if p.is_meta:
                new = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                factors[i] = new
                made = True
    if made:
        layer.reset_lora_parameters()


def meta_tensors(model: torch.nn.Module) -> List[str]:
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]


def model_parallel_in_use() -> bool:
    """Whether torch.distributed and SAT's model-parallel groups are set up in this process."""
    return dist.is_initialized() and mpu.model_parallel_is_initialized()


def open_source(ckpt: Checkpoint, prefix: str = "") -> ShardedSource:
    """Map ``ckpt``'s shards for this rank's model-parallel rank and size."""
    in_use = model_parallel_in_use()
    rank = mpu.get_model_parallel_rank() if in_use else 0
    size = mpu.get_model_parallel_world_size() if in_use else 1
    with stage(f"opening {ckpt.mp_size} shard(s) of '{ckpt.path}' iteration {ckpt.iteration}"):
        return ShardedSource(ckpt, prefix, rank, size)


def fills_every_tensor(model: torch.nn.Module, keys: ShardedSource) -> bool:
    """Can ``model`` (built on meta) be materialised from a checkpoint with these keys alone?"""
    for prefix, module in model.named_modules():
        prefix = prefix + "." if prefix else ""
        for name, t, _, persistent in _tensors(module):
            key = prefix + name
            if key not in keys and key.endswith(".original." + name):  # a LoRA base over a plain checkpoint
                key = key[:-len("original." + name)] + name
            factor = factor_key(key)
            if t.is_meta and key not in keys and factor is not None and factor.layer + ".weight" in keys:
                continue  # LoRA over a layer the checkpoint holds without it: initialised when its layer loads
            if t.is_meta and (_hooked(module) or not persistent or key not in keys):
                return False
    return True


# how many times the files' bytes a model built from a checkpoint's config may take (a 4-bit file of
# a model built fp32 takes 8), plus room for the new tensors a fine-tuning run adds (LoRA, heads)
IMPLIED_BYTES_FACTOR = 8
IMPLIED_BYTES_SLACK = 256 << 20


def check_config_fits_files(model: torch.nn.Module, ckpt) -> None:
    """Refuse, before ``model`` (built on meta) is built for real, a config that implies far more bytes
    than the checkpoint's files hold (each size in range, together a model no file here can fill)."""
    implied = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    held = sum(os.path.getsize(f) for f in ckpt.files)
    if implied > IMPLIED_BYTES_FACTOR * held + IMPLIED_BYTES_SLACK:
        raise CheckpointError(
            f"the model that '{ckpt.path}/model_config.json' describes takes {implied / 2 ** 30:,.1f} GiB, but the "
            f"checkpoint's files hold {held / 2 ** 30:,.3f} GiB: model_config.json does not match the weights (fix "
            f"its sizes to those the checkpoint was trained with); nothing was built")


def model_parallel_rng_tracker():
    """SAT's model-parallel RNG tracker for attention dropout, or None where SAT has none (no CUDA at its import)."""
    get = getattr(mpu, "get_cuda_rng_tracker", None)
    return get() if get is not None else None


def restore_rng(saved: dict, warn: bool = True) -> None:
    """Set Python's, numpy's, torch's (and CUDA's and the model-parallel RNG tracker's) random states
    from a SAT checkpoint's saved dict; a state the checkpoint lacks is left as it is, with a warning
    (``warn=False``: silently, where another checkpoint's states follow)."""
    states = [("random_rng_state", random.setstate), ("np_rng_state", np.random.set_state),
              ("torch_rng_state", torch.set_rng_state)]
    if torch.cuda.is_available():
        states.append(("cuda_rng_state", torch.cuda.set_rng_state))
    tracker = model_parallel_rng_tracker()
    if tracker is not None:  # CUDA runs: the attention-dropout streams of the model-parallel ranks
        states.append(("rng_tracker_states", tracker.set_states))
    absent = [name for name, _ in states if name not in saved]
    for name, setter in states:
        if name in saved:
            setter(saved[name])
    if absent and warn:
        warnings.warn(f"checkpoint has no {', '.join(absent)} (saved with --no-save-rng?): those random "
                      f"states start fresh; pass --no-load-rng to silence this", SatPatchesWarning)
