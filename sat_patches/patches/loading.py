"""Checkpoints load with little host memory, rank-locally, at any model-parallel size.

What SwissArmyTransformer 0.4.12 does: ``load_checkpoint`` ``torch.load``s the whole file into RAM
on every rank; ``from_pretrained(..., overwrite_args={'model_parallel_size': n})`` makes the node's
rank 0 build the full MP=1 model on CPU, load the whole checkpoint into it and ``.cuda()`` + ``send``
every partition (THUDM/SwissArmyTransformer#173, THUDM/CogVLM#283, #320, #162); it mutates the
caller's ``args`` and ``overwrite_args``; from an MP=N checkpoint to MP=N it raises
"model_parallel_size is inconsistent" (THUDM/CogVLM#233).

Here (this module: SAT's entry points and the patches; :mod:`sat_patches.checkpoints.state` loads a
checkpoint's state into a model):

* :mod:`sat_patches.checkpoints.files` checks the checkpoint directory and ``model_config.json``
  before the model is built; :mod:`sat_patches.checkpoints.sharding` reads each rank's own slices, in chunks,
  from the memory-mapped shard files, at any model-parallel size.
* ``from_pretrained`` builds the model on meta (no memory, no init) and materialises it from the
  checkpoint by assignment; when the checkpoint cannot fill every tensor (new mixins), it builds on
  the compute device instead (initialised, as SAT does) and loads into it.
* Ranks meet behind :mod:`sat_patches.core.coordination`'s barriers, which have a timeout;
  ``LOCAL_WORLD_SIZE`` is checked against the ranks that really share a node and ``experiment_name``
  is decided on rank 0 (THUDM/CogVLM#269: per-rank timestamps split one run's checkpoints across
  directories).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import os
import sys
import warnings
from typing import Optional

import torch.distributed as dist

from . import construction, devices
from ..core.registry import Patch, SatPatchesWarning, expect_names, expect_params
from ..checkpoints import adapter, safe_load
from ..checkpoints.files import Checkpoint, CheckpointError, find_checkpoint, read_model_config
from ..checkpoints.sharding import ShardedSource
from ..checkpoints.state import (check_config_fits_files, fills_every_tensor, load_state, materialise_device,
                                 meta_tensors, open_source, restore_rng)
from ..core.coordination import barrier, check_local_world_size, group_store, stage, store_gather


# --------------------------------------------------------------------------------------
# SAT entry points
# --------------------------------------------------------------------------------------

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


def load_checkpoint(model, args, load_path=None, prefix="", specific_iteration=None, *,
                    source: Optional[ShardedSource] = None, all_ranks: Optional[bool] = None):
    """SAT's ``load_checkpoint`` (same arguments, same return: the iteration to resume from), reading
    this rank's slices from mapped files at any model-parallel size. With ``all_ranks`` (every rank
    loads: ``from_pretrained``, ``training_main``) the ranks meet at a :func:`barrier` afterwards."""
    from sat.helpers import print_rank0
    if load_path is None and specific_iteration is None:  # training_main's --load: --iteration chooses
        specific_iteration = getattr(args, "load_iteration", None)
    source = source or open_source(find_checkpoint(load_path or args.load, specific_iteration), prefix)
    ckpt = source.ckpt
    mode = getattr(args, "mode", "inference")
    module = model.module if hasattr(model, "module") else model
    from .lora import nf4_as_loaded
    manifest = adapter.read_manifest(os.path.dirname(ckpt.files[0]))
    if manifest is not None:  # adapters only: onto the base the model already holds
        base = getattr(module, adapter.BASE_ATTRIBUTE, None)
        if base is None:
            raise adapter.AdapterError(
                f"{ckpt.path} iteration {ckpt.iteration} holds LoRA adapters only: load its base first "
                f"(from_pretrained('{manifest['base']['path']}'), then add LoRA as the run did), then this")
        adapter.check_base(manifest, base, ckpt.path)
    with stage(f"loading '{ckpt.path}' iteration {ckpt.iteration} (MP={ckpt.mp_size} -> MP={source.size})"):
        convert = nf4_as_loaded(module, args)
        # layers converted as they load (QLoRA's NF4) are copied: lent, their pages would stay mapped after it
        missing, unexpected = load_state(module, source, after=convert, lend=convert is None)
    if manifest is not None:  # the base's tensors are not in it; the adapters must be
        missing = [k for k in missing if adapter.is_adapter(k)]
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
        restore_rng(source.own)
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


def build_and_load(model_cls, args, ckpt: Checkpoint, prefix: str = "", **kwargs):
    """Build ``model_cls(args)`` and load ``ckpt`` on every rank: on meta then materialised from the
    checkpoint when it holds every tensor, else on the compute device (initialised, as SAT's
    ``get_model``) then loaded into."""
    from sat.helpers import print_rank0
    source = open_source(ckpt, prefix)  # before building: a damaged file stops here
    with stage(f"building {model_cls.__name__} on meta"):
        model = _build(args, model_cls, kwargs, on_meta=True)
    if not fills_every_tensor(model, source):
        check_config_fits_files(model, ckpt)
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
# Patches
# --------------------------------------------------------------------------------------

def _load_checkpoint(original):
    """SAT's load_checkpoint, mapped and rank-local; ZeRO-3 models keep SAT's own path."""
    @functools.wraps(original)
    def wrapper(model, args, load_path=None, prefix="", specific_iteration=None):
        from sat.helpers import check_if_zero3
        if check_if_zero3(args):
            from sat.training import model_io
            with safe_load.module_loads_safely(model_io):
                return original(model, args, load_path=load_path, prefix=prefix,
                                specific_iteration=specific_iteration)
        return load_checkpoint(model, args, load_path, prefix, specific_iteration)
    return wrapper


def _from_pretrained(auto: bool):
    """SAT's from_pretrained, rank-local at any MP size; under ZeRO-3 SAT's own (zero.Init places weights)."""
    def make(original):
        @functools.wraps(original.__func__)
        def wrapper(cls, name, args=None, **kwargs):
            from sat.helpers import check_if_zero3
            if args is not None and check_if_zero3(args):
                from sat.training import model_io
                with safe_load.module_loads_safely(model_io):
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


class SharedStartClock:
    """Stands in for the ``datetime`` class in SAT's training module (``from datetime import datetime``).

    Everything is the real class's, except that after :meth:`share` the next ``now()`` returns the
    shared time (rank 0's start, which SAT's ``training_main`` turns into ``experiment_name``); later
    calls return the real time again."""

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


def _shared_start_clock(original):
    return SharedStartClock(original)


def _expect_datetime_class(original):
    return None if original is datetime.datetime else f"it is {original!r}, not the datetime class"


_runs = 0


def _training_main(original):
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def training_main(args, *a, **kw):
        timestamped = not (args.load and args.mode == "pretrain")
        global _runs
        clock = getattr(module, "datetime", None)
        shared = isinstance(clock, SharedStartClock) and timestamped and group_store() is not None
        if shared:
            _runs += 1
            start = clock.real.now().isoformat() if dist.get_rank() == 0 else ""
            clock.share(clock.real.fromisoformat(store_gather(f"start/{_runs}", start)[0]))
        try:
            with all_ranks_loading():
                return original(args, *a, **kw)
        finally:
            if shared:
                clock.share(None)
    return training_main


def _expect_from_pretrained(original):
    return expect_names("mp_split_model_rank0", "from_pretrained_base")(original) or \
        expect_params("overwrite_args", "use_node_group")(original)


PATCHES = [
    Patch("load_checkpoint_mmap", "sat.training.model_io:load_checkpoint", _load_checkpoint,
          answers="THUDM/CogVLM#283, #320, #162: every rank torch.loads the whole checkpoint into RAM (no mmap); "
                  "MP=N checkpoints load only at MP=N",
          expect=expect_names("get_checkpoint_name", "load_state_dict", "reinit")),
    Patch("from_pretrained_rank_local", "sat.model.base_model:BaseModel.from_pretrained", _from_pretrained(False),
          answers="THUDM/SwissArmyTransformer#173, THUDM/CogVLM#162, #233: MP>1 from_pretrained builds the full "
                  "model on node rank 0 and sends partitions (.cuda()); MP=N to MP=N raises "
                  "'model_parallel_size is inconsistent'; mutates the caller's args",
          expect=_expect_from_pretrained),
    Patch("automodel_from_pretrained_rank_local", "sat.model.base_model:AutoModel.from_pretrained",
          _from_pretrained(True),
          answers="THUDM/SwissArmyTransformer#173, THUDM/CogVLM#233: AutoModel.from_pretrained, same "
                  "model-parallel path as BaseModel's",
          expect=_expect_from_pretrained),
    Patch("local_world_size_check", "sat.mpu.initialize:initialize_model_parallel", _initialize_model_parallel,
          answers="THUDM/SwissArmyTransformer#173, CogVLM's finetune_demo: LOCAL_WORLD_SIZE=8 from .deepspeed_env "
                  "on a 2-GPU box leaves SAT's node groups empty ('node group is not initialized')",
          expect=expect_names("environ", "_NODE_GROUP", "new_group")),
    Patch("shared_experiment_start", "sat.training.deepspeed_training:datetime", _shared_start_clock,
          answers="THUDM/CogVLM#269: SAT's training module reads the clock of each rank for experiment_name; "
                  "it gets a clock whose first now() in training_main is rank 0's start time",
          expect=_expect_datetime_class),
    Patch("shared_experiment_name", "sat.training.deepspeed_training:training_main", _training_main,
          answers="THUDM/CogVLM#269: experiment_name timestamps differ per rank, one MP run saves into two "
                  "directories; rank 0's start time is shared (with shared_experiment_start)",
          expect=expect_names("experiment_name", "datetime", "strftime")),
]
