"""Loading SAT checkpoints rank-locally with little host memory: models built on meta and each rank reading
only its own slices of the memory-mapped files (:func:`load_checkpoint`, :func:`from_pretrained`,
:func:`build_and_load`), at any model-parallel size.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from typing import Optional

import torch.distributed as dist
from sat import mpu
from sat.arguments import _simple_init, overwrite_args_by_dict, reset_random_seed, update_args_with_file
from sat.helpers import check_if_zero3, print_rank0
from sat.model.base_model import get_model
from sat.model.registry import model_registry
from sat.resources import auto_create
from sat.training import model_io

from ..checkpoints import adapter, safe_load
from ..checkpoints.files import Checkpoint, CheckpointError, find_checkpoint
from ..checkpoints.model_config import read_model_config
from ..checkpoints.lora_names import is_adapter
from ..checkpoints.sharding import ShardedSource
from ..checkpoints.state import (check_config_fits_files, fills_every_tensor, load_state, materialise_device,
                                 meta_tensors, model_parallel_in_use, open_source, restore_rng,)
from ..core.coordination import barrier, group_store, stage, store_gather
from ..core.registry import SatPatchesWarning
from ..lora import qlora
from ..runtime import construction, devices

_all_ranks_load = False  # True inside training_main: every rank calls load_checkpoint


def load_checkpoint(model, args, load_path=None, prefix="", specific_iteration=None, *,
                    source: Optional[ShardedSource] = None, all_ranks: Optional[bool] = None):
    """SAT's ``load_checkpoint`` (same arguments, same return: the iteration to resume from), reading
    this rank's slices from mapped files at any model-parallel size. With ``all_ranks`` (every rank
    loads: ``from_pretrained``, ``training_main``) the ranks meet at a :func:`barrier` afterwards."""
    if load_path is None and specific_iteration is None:  # training_main's --load: --iteration chooses
        specific_iteration = getattr(args, "load_iteration", None)
    source = source or open_source(find_checkpoint(load_path or args.load, specific_iteration), prefix)
    ckpt = source.ckpt
    mode = getattr(args, "mode", "inference")
    module = model.module if hasattr(model, "module") else model
    manifest = adapter.read_manifest(os.path.dirname(ckpt.files[0]))
    base_missing = set()  # what neither the adapters nor their base hold
    if manifest is not None:  # adapters only: onto their base, loaded first unless the model holds it
        base = getattr(module, adapter.BASE_ATTRIBUTE, None)
        if base is None:  # one --load (CogVideoX's train_video.py, sample_video.py): the base, then the adapters
            base_ckpt = adapter.base_checkpoint(manifest, ckpt.path)  # refused when it changed
            with stage(f"loading the base '{base_ckpt.path}' of the adapters in '{ckpt.path}'"):
                base_missing = set(_load_state(module, args, open_source(base_ckpt, prefix))[0])
            base = manifest["base"]
            setattr(module, adapter.BASE_ATTRIBUTE, base)
        adapter.check_base(manifest, base, ckpt.path)
    with stage(f"loading '{ckpt.path}' iteration {ckpt.iteration} (MP={ckpt.mp_size} -> MP={source.size})"):
        missing, unexpected = _load_state(module, args, source)
    if manifest is not None:  # the base's tensors are not in it; the adapters must be
        missing = [k for k in missing if is_adapter(k) or k in base_missing]
    else:
        setattr(module, adapter.BASE_ATTRIBUTE, adapter.fingerprint(ckpt))
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
        # a resumed run loads its base (``from_pretrained``: no random states) before the run it continues
        # (``--load``, or no --load at all), whose states count: only that one's absence is said
        run = getattr(args, "load", None)
        restore_rng(source.own, warn=not run or os.path.realpath(ckpt.path) == os.path.realpath(run))
    elif mode == "inference":
        module.eval()
    del source
    if _all_ranks_load if all_ranks is None else all_ranks:
        barrier(f"loaded '{ckpt.path}'")
    print_rank0(f"> loaded {ckpt.path} iteration {ckpt.iteration} (MP={ckpt.mp_size}) with sat_patches")
    return iteration


def _load_state(module, args, source):
    """``load_state`` of ``source`` into ``module``: (missing, unexpected)."""
    convert = qlora.nf4_as_loaded(module, args)
    # what a converter (QLoRA's NF4) converts as it loads is copied, not lent (its pages would stay mapped);
    # under a converter that does not say what it converts, everything is copied
    converts = getattr(convert, "converts", None)
    lend = (lambda m: not converts(m)) if converts else convert is None
    return load_state(module, source, after=convert, lend=lend)


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


def _build_on_meta(args, model_cls, kwargs):
    """Build like SAT's ``get_model``, on meta without initialising or moving anything."""
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


def build_and_load(model_cls, args, ckpt: Checkpoint, prefix: str = "", **kwargs):
    """Build ``model_cls(args)`` and load ``ckpt`` on every rank: on meta then materialised from the
    checkpoint when it holds every tensor, else on the compute device (initialised, as SAT's
    ``get_model``) then loaded into."""
    source = open_source(ckpt, prefix)  # before building: a damaged file stops here
    with stage(f"building {model_cls.__name__} on meta"):
        model = _build_on_meta(args, model_cls, kwargs)
    if not fills_every_tensor(model, source):
        check_config_fits_files(model, ckpt)
        print_rank0(f"building {model_cls.__name__} on {devices.compute_device()}: the checkpoint does "
                    f"not hold every tensor of the model ({', '.join(meta_tensors(model)[:3])} ...)")
        with stage(f"building {model_cls.__name__} on {devices.compute_device()}"):
            model = get_model(args, model_cls, **kwargs)
    load_checkpoint(model, args, prefix=prefix, source=source, all_ranks=True)
    return model.to(materialise_device())


def ensure_model_parallel(args) -> None:
    """torch.distributed and model-parallel groups of ``args.model_parallel_size``, before the model is
    built (SAT's ``BaseModel`` sets them up the same way; its ``from_pretrained`` re-creates them)."""
    size = getattr(args, "model_parallel_size", 1)
    if model_parallel_in_use() and mpu.get_model_parallel_world_size() != size:
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(size)
    _simple_init(model_parallel_size=size, seed=getattr(args, "seed", 1234))


def _check_model_parallel_size(args, model_path: str, saved: int) -> None:
    """Say which model-parallel size the model loads at and which the checkpoint holds; stop, before
    anything is built, where that size cannot be honoured."""
    size = getattr(args, "model_parallel_size", 1)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    problems = []
    if size < 1 or world % size:
        problems.append(f"it does not divide the {world} rank(s) of this run")
    for key in ("num_attention_heads", "num_multi_query_heads", "hidden_size", "inner_hidden_size"):
        value = getattr(args, key, None)
        if isinstance(value, int) and size >= 1 and value % size:
            problems.append(f"{key} {value} does not split into {size} equal parts")
    if problems:
        raise CheckpointError(f"model-parallel size {size} cannot be used for '{model_path}' (saved at "
                              f"model-parallel size {saved}): {'; '.join(problems)}. Pass a --model-parallel-size "
                              f"(or overwrite_args={{'model_parallel_size': n}}) that divides the ranks and the "
                              f"heads: the checkpoint is split or joined on load to any such size")
    how = "as saved" if size == saved else f"{'split' if size > saved else 'joined'} on load"
    print_rank0(f"model-parallel size {size}; '{model_path}' was saved at model-parallel size {saved} ({how})")


def from_pretrained(model_cls, name, args=None, *, home_path=None, url=None, prefix="", build_only=False,
                    use_node_group=True, overwrite_args=None, **kwargs):
    """SAT's ``from_pretrained``, every rank building and loading only its own partition, the caller's
    ``args`` and ``overwrite_args`` left as they were; ``model_cls`` None means AutoModel. The model-parallel
    size is ``overwrite_args``', else the one this process runs at (a script's ``--model-parallel-size``),
    else the checkpoint's; a size the model cannot be split into stops here."""
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
    saved_mp = getattr(args, "model_parallel_size", 1)  # the size the checkpoint was saved at
    if "model_parallel_size" not in overwrite and model_parallel_in_use():
        # the run's size (the script's --model-parallel-size): the checkpoint is split or joined to it
        overwrite["model_parallel_size"] = mpu.get_model_parallel_world_size()
    args = overwrite_args_by_dict(args, overwrite_args=overwrite)
    _check_model_parallel_size(args, model_path, ckpt.mp_size if ckpt else saved_mp)
    if model_cls is None:
        model_cls = model_registry.get(args.model_class)
        if null_args:
            for k, v in vars(model_cls.get_args()).items():
                if not hasattr(args, k):
                    setattr(args, k, v)
    ensure_model_parallel(args)
    if build_only:
        return get_model(args, model_cls, **kwargs), args
    model = build_and_load(model_cls, args, ckpt, prefix, **kwargs)
    new_mp = (overwrite_args or {}).get("model_parallel_size")
    if new_mp is not None and (new_mp != 1 or caller_mp == 1):
        reset_random_seed(6)  # as SAT's model-parallel branch does after splitting
    return model, args


class SharedStartClock:
    """Stands in for the ``datetime`` class in SAT's training module: everything is the real class's, except
    that after :meth:`share` the next ``now()`` returns the shared time (rank 0's start)."""

    def __init__(self, real):
        self.real = real
        self._shared = None

    def share(self, start) -> None:
        """The next ``now()`` returns ``start`` (None: the real time)."""
        self._shared = start

    def now(self, tz=None):
        shared, self._shared = self._shared, None
        return self.real.now(tz) if shared is None else shared

    def __call__(self, *args, **kwargs):
        return self.real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __instancecheck__(self, obj):
        return isinstance(obj, self.real)

    def __subclasscheck__(self, cls):
        return issubclass(cls, self.real)


def load_checkpoint_unless_zero3(original, model, args, load_path=None, prefix="", specific_iteration=None):
    """:func:`load_checkpoint` in place of SAT's (``original``); ZeRO-3 models keep SAT's (with safe loads)."""
    if check_if_zero3(args):
        with safe_load.module_loads_safely(model_io):
            return original(model, args, load_path=load_path, prefix=prefix, specific_iteration=specific_iteration)
    return load_checkpoint(model, args, load_path, prefix, specific_iteration)


def from_pretrained_unless_zero3(original, auto: bool, cls, name, args=None, **kwargs):
    """:func:`from_pretrained` in place of SAT's ``BaseModel``/``AutoModel`` (``auto``) one (``original``, the
    function under the classmethod); under ZeRO-3 SAT's own (zero.Init places the weights)."""
    if args is not None and check_if_zero3(args):
        with safe_load.module_loads_safely(model_io):
            return original(cls, name, args, **kwargs)
    return from_pretrained(None if auto else cls, name, args, **kwargs)


_runs = 0  # runs of training_main that shared rank 0's start time (names each exchange in the store)


def training_main_with_shared_start(original, args, *a, **kw):
    """SAT's ``training_main`` (``original``) with rank 0's start time on every rank (through the
    :class:`SharedStartClock` standing in for its module's ``datetime``), every rank loading checkpoints inside it."""
    global _runs, _all_ranks_load
    clock = getattr(sys.modules[original.__module__], "datetime", None)
    timestamped = not (args.load and args.mode == "pretrain")
    shared = isinstance(clock, SharedStartClock) and timestamped and group_store() is not None
    if shared:
        _runs += 1
        start = clock.real.now().isoformat() if dist.get_rank() == 0 else ""
        clock.share(clock.real.fromisoformat(store_gather(f"start/{_runs}", start)[0]))
    previous, _all_ranks_load = _all_ranks_load, True
    try:
        return original(args, *a, **kw)
    finally:
        _all_ranks_load = previous
        if shared:
            clock.share(None)
