"""Exact resume: ZeRO optimizer shards saved and loaded, the learning-rate schedule and random states
restored, and a batch sampler that continues from the saved position.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from sat import mpu
from sat.helpers import check_if_zero3

from ..checkpoints import safe_load
from ..checkpoints.files import CheckpointError, find_checkpoint
from ..checkpoints.state import restore_rng
from ..core.registry import SatPatchesWarning


def resuming(args) -> bool:
    """``training_main`` continuing a run: ``--mode pretrain --load`` with a loaded iteration > 0
    (not under ZeRO-3, whose z3_rank_* checkpoints SAT loads its own way)."""
    return (getattr(args, "mode", None) == "pretrain" and bool(getattr(args, "load", None))
            and int(getattr(args, "iteration", 0) or 0) > 0 and not check_if_zero3(args))


def _zero_sharded(engine) -> bool:
    """The optimizer keeps per-rank partitions that DeepSpeed saves as ``*_optim_states.pt``
    (ZeRO stage 1/2, and the bf16 optimizer)."""
    return hasattr(getattr(engine, "optimizer", None), "dp_process_group") and hasattr(engine, "_save_zero_checkpoint")


_opened: dict = {}


def _model_states(args) -> Optional[dict]:
    """This rank's ``mp_rank_XX_model_states.pt`` of the checkpoint being resumed, mapped once per resume; None
    (with a warning) when the checkpoint has another model-parallel size than this run."""
    key = (args.load, int(args.iteration))
    if key not in _opened:
        _opened.clear()
        ckpt = find_checkpoint(args.load, int(args.iteration))
        if ckpt.mp_size != mpu.get_model_parallel_world_size():
            warnings.warn(f"resuming '{args.load}' (MP={ckpt.mp_size}) at MP={mpu.get_model_parallel_world_size()}: "
                          f"optimizer, schedule and random states are per model-parallel rank and start fresh; "
                          f"resume at MP={ckpt.mp_size} to continue exactly", SatPatchesWarning)
            _opened[key] = None
        else:
            _opened[key] = ckpt.open(mpu.get_model_parallel_rank())
    return _opened[key]


def save_optimizer_states(engine, save_dir: str, iteration) -> None:
    """Write this rank's ZeRO optimizer shard into ``<save_dir>/<iteration>/`` (DeepSpeed's format and
    name, so ``zero_to_fp32.py`` and ``engine.load_checkpoint`` read it too). Every rank calls this."""
    if not _zero_sharded(engine):
        return  # without ZeRO, DeepSpeed puts the optimizer into the model states SAT writes
    os.makedirs(os.path.join(save_dir, str(iteration)), exist_ok=True)
    if getattr(engine, "save_zero_checkpoint", True):
        engine._save_zero_checkpoint(save_dir, str(iteration))


def load_optimizer_states(engine, args) -> bool:
    """Load the optimizer of the checkpoint being resumed into DeepSpeed's ``engine``; False (with a
    warning) when the checkpoint has none."""
    states = _model_states(args)
    if states is None:
        return False
    # param_groups' 'lr' holds SAT's per-group scale until AnnealingLR (built next) reads it; a loaded
    # state_dict would put the saved absolute rate there
    scales = [group.get("lr") for group in engine.optimizer.param_groups]
    loaded = _load_optimizer(engine, args, states)
    for group, scale in zip(engine.optimizer.param_groups, scales):
        group["lr"] = scale
    return loaded


def _load_optimizer(engine, args, states: dict) -> bool:
    if _zero_sharded(engine):
        engine.loaded_checkpoint_dp_world_size = states.get("dp_world_size", engine.dp_world_size)
        engine.loaded_checkpoint_mp_world_size = states.get("mp_world_size", engine.mp_world_size)
        names = engine._get_all_zero_checkpoint_names(args.load, str(args.iteration), engine.bfloat16_enabled())
        present = [os.path.isfile(n) for n in names]
        if not any(present):
            return _fresh(args, f"no ZeRO optimizer shards ({os.path.basename(names[0])}, ...)")
        if not all(present):
            raise CheckpointError(f"'{args.load}' iteration {args.iteration} lacks "
                                  f"{', '.join(n for n, p in zip(names, present) if not p)}: copy it, or resume from "
                                  f"another iteration")
        # SAT's bundled ZeRO configs say load_from_fp32_weights: false (SAT never saved these shards): the
        # fp32 master weights would be rebuilt from the bf16/fp16 model, off by a rounding at every step
        zero_config = engine._config.zero_config
        configured = zero_config.load_from_fp32_weights
        zero_config.load_from_fp32_weights = True
        try:
            with safe_load.deepspeed_loads_safely(engine):
                return _load_zero_shards(engine, args)
        finally:
            zero_config.load_from_fp32_weights = configured
    saved = states.get("optimizer")
    if saved is None:
        return _fresh(args, "no optimizer states")
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        engine.optimizer.load_state_dict(saved, load_optimizer_states=True)
    else:
        engine.optimizer.load_state_dict(saved)
    return True


def _load_zero_shards(engine, args) -> bool:
    """DeepSpeed's ZeRO load. Where this run's config saves elastic shards (the finetune scripts' copies do), DeepSpeed's
    elastic restore with torch's Adam step filled in, also for shards saved by another number of data-parallel ranks
    (a run resumed on other nodes, its global batch kept), which DeepSpeed's load refuses; such a checkpoint saved
    rigid is refused with what to do."""
    tag, saved, now = str(args.iteration), engine.loaded_checkpoint_dp_world_size, engine.seq_dp_world_size
    elastic = getattr(engine.optimizer, "elastic_checkpoint", False)
    if saved == now and not elastic:
        return bool(engine._load_zero_checkpoint(args.load, tag, load_optimizer_states=True))
    shards = engine._get_all_zero_checkpoints(args.load, tag) or []
    present = [s for s in shards if s is not None]
    if not present or not elastic or any(isinstance(s.get("base_optimizer_state"), dict) for s in present):
        raise CheckpointError(
            f"'{args.load}' iteration {tag} was saved by {saved} data-parallel rank(s) and this run has {now}: its "
            f"ZeRO optimizer shards can be split again only where the saving and this run's DeepSpeed configs both "
            f"set zero_optimization.elastic_checkpoint (the finetune scripts' copies do): resume with {saved} "
            f"data-parallel ranks (ranks / MP_SIZE), or set it in both")
    for shard in present:  # torch's Adam keeps its step in each parameter's state, where DeepSpeed does not look
        step = shard["base_optimizer_state"][0].get("step")
        shard.setdefault("base_optimizer_state_step", int(step) if step is not None else None)
    engine.optimizer.load_state_dict(state_dict_list=shards, load_optimizer_states=True,
                                     load_from_fp32_weights=engine.zero_load_from_fp32_weights(),
                                     param_shapes=engine._get_zero_param_shapes())
    return True


def _fresh(args, what: str) -> bool:
    warnings.warn(f"resuming from '{args.load}' iteration {args.iteration}: the checkpoint has {what} (saved by "
                  f"stock SAT?); the optimizer starts fresh, so the resumed losses differ from an uninterrupted "
                  f"run's", SatPatchesWarning)
    return False


SCHEDULE_KEYS = ("init_step", "auto_warmup_steps", "auto_warmup_rate")


def restore_lr_schedule(scheduler, args) -> bool:
    """Continue SAT's ``AnnealingLR`` where the stopped run left it (SAT re-warms it from 100 iterations back)."""
    states = _model_states(args)
    saved = (states or {}).get("client_lr_scheduler") or {}
    if not all(k in saved for k in SCHEDULE_KEYS + ("num_iters",)):
        warnings.warn(f"resuming from '{args.load}' iteration {args.iteration}: the checkpoint does not record the "
                      f"learning-rate schedule's warm-up (saved by stock SAT?); SAT's resume schedule applies "
                      f"(5% of the rate for up to 100 iterations)", SatPatchesWarning)
        return False
    for key in SCHEDULE_KEYS:
        setattr(scheduler, key, saved[key])
    scheduler.step(saved["num_iters"])
    return True


class ResumableBatchSampler(torch.utils.data.BatchSampler):
    """A ``BatchSampler`` that skips the micro-batches of its first ``start_iter`` iterations (``accumulation``
    each) once, as SAT's ``DistributedBatchSampler`` does (indices only: no sample of a skipped batch is loaded)."""

    start_iter = 0
    accumulation = 1

    def __iter__(self):
        skip, self.start_iter = self.start_iter * self.accumulation, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                yield batch


def resumable(loader, accumulation: int = 1):
    """``loader`` with a :class:`ResumableBatchSampler` in place of a plain ``BatchSampler`` (``accumulation``
    micro-batches an iteration)."""
    sampler = loader.batch_sampler
    if type(sampler) is not torch.utils.data.BatchSampler:
        return loader  # SAT's DistributedBatchSampler (reads start_iter itself), or the user's own
    resuming = ResumableBatchSampler(sampler.sampler, sampler.batch_size, sampler.drop_last)
    resuming.accumulation = accumulation
    return torch.utils.data.DataLoader(
        loader.dataset, batch_sampler=resuming,
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, collate_fn=loader.collate_fn,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None)


class RestoreRngAfterIter:
    """A data loader whose ``iter()`` is followed by ``restore()``. ``train`` creates the train and
    validation iterators first, and each draws a seed from torch's generator (as it did at the start of
    the stopped run): the saved states go back after the last of those draws."""

    def __init__(self, loader, restore):
        self._loader, self._restore = loader, restore

    def __iter__(self):
        iterator = iter(self._loader)
        restore, self._restore = self._restore, lambda: None   # once: not at every later evaluation
        restore()
        return iterator

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def train_restoring_rng(original, model, optimizer, lr_scheduler, train_data, val_data, timers, args, *a, **kw):
    """SAT's ``train`` (``original``); a resumed run's random states (re-seeded by ``training_main``) are restored
    again from the checkpoint once ``train`` has created its data iterators (:class:`RestoreRngAfterIter`)."""
    if resuming(args):
        def restore():
            states = None if getattr(args, "no_load_rng", False) else _model_states(args)
            if states is not None:
                restore_rng(states)
            _opened.clear()  # the resumed checkpoint's mapped states: everything is restored from them
        if val_data is not None:
            val_data = RestoreRngAfterIter(val_data, restore)
        elif train_data is not None:
            train_data = RestoreRngAfterIter(train_data, restore)
        else:
            restore()
    return original(model, optimizer, lr_scheduler, train_data, val_data, timers, args, *a, **kw)
