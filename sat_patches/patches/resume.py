"""Exact resume: a run stopped after a checkpoint and continued with
``--mode pretrain --load <run>`` gives the losses the uninterrupted run would have given.

What SwissArmyTransformer 0.4.12 loses on resume (``sat/training``), each answered by one patch here:

* ``resume_optimizer_save`` / ``resume_optimizer_load`` -- the optimizer. ``save_ds_checkpoint_no_optim``
  writes no ZeRO optimizer shards and ``load_checkpoint`` says "only load module": Adam's moments (and
  the ZeRO/bf16 fp32 master weights) start from zero, so the first resumed steps jump. Now every rank
  writes DeepSpeed's own ``*_optim_states.pt`` shard beside SAT's model states, and after DeepSpeed
  is set up the optimizer is loaded from it, fp32 master weights included (SAT's bundled ZeRO configs
  say ``load_from_fp32_weights: false``, which would round them through bf16); without ZeRO, from the
  ``optimizer`` entry DeepSpeed already keeps in ``mp_rank_XX_model_states.pt``. The model weights
  are not read a second time.
* ``resume_lr_schedule_state`` / ``resume_lr_schedule`` -- the learning rate. SAT rebuilds a resumed
  run's ``AnnealingLR`` as a new one starting 100 iterations back at 5% of the rate (its re-warm for
  the optimizer it did not restore); ``AnnealingLR.state_dict`` now records where the warm-up began,
  and the resumed schedule continues from the saved one.
* ``resume_rng`` -- the random states. ``load_checkpoint`` restores them, but ``training_main`` then
  re-seeds every generator with ``--seed`` right before ``train``: dropout replays the first steps'
  masks. They are restored again from the checkpoint once ``train`` has created its data iterators
  (each draws a seed from torch's generator, as it did at the start of the stopped run).
* ``resume_data_position`` -- the data order. ``--resume-dataloader`` sets ``batch_sampler.start_iter``,
  which only SAT's ``DistributedBatchSampler`` reads; with one data-parallel rank (e.g. MP=2 on 2 GPUs,
  CogVLM's model-parallel set-up) the loader has a plain ``BatchSampler`` and silently starts from the
  first batch again. Every training loader now honours ``start_iter``, and resuming sets
  ``resume_dataloader`` (a continued run is meant to continue, not to re-read its first batches).

* ``resume_iteration_arg`` -- which iteration. SAT resumes from the iteration named in ``latest`` only;
  ``--iteration N`` (with ``--load <run>``) resumes from the saved ``<run>/N`` instead, just as exactly.

ZeRO-3 runs keep SAT's own save and load. Exactness assumes the same world size, model-parallel size and batch settings as the stopped run
(DeepSpeed refuses a ZeRO checkpoint of another data-parallel size with its own message), and a
checkpoint saved without ``--no-save-rng``. A checkpoint written by stock SAT has no optimizer shards:
the optimizer then starts fresh, with a warning.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

from ..checkpoints import safe_load
from ..checkpoints.files import CheckpointError
from ..core.registry import Patch, SatPatchesWarning, expect_names, expect_params


def resuming(args) -> bool:
    """``training_main`` continuing a run: ``--mode pretrain --load`` with a loaded iteration > 0
    (not under ZeRO-3, whose z3_rank_* checkpoints SAT loads its own way)."""
    from sat.helpers import check_if_zero3
    return (getattr(args, "mode", None) == "pretrain" and bool(getattr(args, "load", None))
            and int(getattr(args, "iteration", 0) or 0) > 0 and not check_if_zero3(args))


def _zero_sharded(engine) -> bool:
    """The optimizer keeps per-rank partitions that DeepSpeed saves as ``*_optim_states.pt``
    (ZeRO stage 1/2, and the bf16 optimizer)."""
    return hasattr(getattr(engine, "optimizer", None), "dp_process_group") and hasattr(engine, "_save_zero_checkpoint")


_opened: dict = {}


def _model_states(args) -> Optional[dict]:
    """This rank's ``mp_rank_XX_model_states.pt`` of the checkpoint being resumed, memory-mapped (opened
    once per resume: weights are not read); None (with a warning) when the checkpoint has another
    model-parallel size than this run."""
    from sat import mpu
    from ..checkpoints.files import find_checkpoint
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
                return bool(engine._load_zero_checkpoint(args.load, str(args.iteration), load_optimizer_states=True))
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


def _fresh(args, what: str) -> bool:
    warnings.warn(f"resuming from '{args.load}' iteration {args.iteration}: the checkpoint has {what} (saved by "
                  f"stock SAT?); the optimizer starts fresh, so the resumed losses differ from an uninterrupted "
                  f"run's", SatPatchesWarning)
    return False


SCHEDULE_KEYS = ("init_step", "auto_warmup_steps", "auto_warmup_rate")


def restore_lr_schedule(scheduler, args) -> bool:
    """Continue SAT's ``AnnealingLR`` where the stopped run left it. SAT instead rebuilds it as a
    fresh run starting ``auto_warmup_steps`` (100) iterations before the loaded one, at 5% of the
    rate for those 100 iterations (a re-warm for the optimizer states it did not restore)."""
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


def restore_rng_states(args) -> None:
    """Put back the random states saved with the checkpoint being resumed (SAT re-seeded them)."""
    if getattr(args, "no_load_rng", False):
        return
    from ..checkpoints.state import restore_rng
    states = _model_states(args)
    if states is not None:
        restore_rng(states)


class ResumableBatchSampler(torch.utils.data.BatchSampler):
    """A ``BatchSampler`` that skips its first ``start_iter`` batches once, as SAT's
    ``DistributedBatchSampler`` does (indices only: no sample of a skipped batch is loaded)."""

    start_iter = 0

    def __iter__(self):
        skip, self.start_iter = self.start_iter, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                yield batch


def resumable(loader):
    """``loader`` with a :class:`ResumableBatchSampler` in place of a plain ``BatchSampler``."""
    sampler = loader.batch_sampler
    if type(sampler) is not torch.utils.data.BatchSampler:
        return loader  # SAT's DistributedBatchSampler (reads start_iter itself), or the user's own
    return torch.utils.data.DataLoader(
        loader.dataset, batch_sampler=ResumableBatchSampler(sampler.sampler, sampler.batch_size, sampler.drop_last),
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, collate_fn=loader.collate_fn,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None)


# --------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------
def _save_checkpoint(original):
    """SAT saves no ZeRO optimizer shards (``save_ds_checkpoint_no_optim``; CogVLM finetune resume)."""
    @functools.wraps(original)
    def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):
        from sat.helpers import check_if_zero3
        if getattr(args, "save", None) and not check_if_zero3(args):
            save_optimizer_states(model, args.save, iteration)  # before SAT's closing barrier
        return original(iteration, model, optimizer, lr_scheduler, args)
    return save_checkpoint


def _setup_model_and_optimizer(original):
    """SAT's ``load_checkpoint`` loads "only module": the optimizer of a resumed run starts from zero."""
    @functools.wraps(original)
    def setup_model_untrainable_params_and_optimizer(args, model, *a, **kw):
        engine, optimizer = original(args, model, *a, **kw)
        if resuming(args) and optimizer is not None and hasattr(engine, "optimizer"):
            load_optimizer_states(engine, args)
            args.resume_dataloader = True
        return engine, optimizer
    return setup_model_untrainable_params_and_optimizer


def _lr_state_dict(original):
    """``AnnealingLR.state_dict`` leaves out where its warm-up started: a resumed run cannot rebuild it."""
    @functools.wraps(original)
    def state_dict(self):
        saved = original(self)
        saved.update({key: getattr(self, key) for key in SCHEDULE_KEYS})
        return saved
    return state_dict


def _get_learning_rate_scheduler(original):
    """SAT rebuilds a resumed run's schedule as a new one with a 100-iteration re-warm."""
    @functools.wraps(original)
    def get_learning_rate_scheduler(optimizer, iteration, args, *a, **kw):
        scheduler = original(optimizer, iteration, args, *a, **kw)
        if resuming(args):
            restore_lr_schedule(scheduler, args)
        return scheduler
    return get_learning_rate_scheduler


class _RestoreRngAfterIter:
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


def _train(original):
    """``training_main`` re-seeds every generator with ``--seed`` after loading the checkpoint's states."""
    @functools.wraps(original)
    def train(model, optimizer, lr_scheduler, train_data, val_data, timers, args, *a, **kw):
        if resuming(args):
            def restore():
                restore_rng_states(args)
                _opened.clear()
            if val_data is not None:
                val_data = _RestoreRngAfterIter(val_data, restore)
            elif train_data is not None:
                train_data = _RestoreRngAfterIter(train_data, restore)
            else:
                restore()
        return original(model, optimizer, lr_scheduler, train_data, val_data, timers, args, *a, **kw)
    return train


def _make_data_loader(original):
    """``start_iter`` (``--resume-dataloader``) is ignored with one data-parallel rank: plain BatchSampler."""
    @functools.wraps(original)
    def make_data_loader(dataset, batch_size, args, split, collate_fn=None):
        loader = original(dataset, batch_size, args, split, collate_fn=collate_fn)
        return resumable(loader) if split == "train" else loader
    return make_data_loader


def _add_training_args(original):
    """sat/arguments.py add_training_args: ``--load`` always follows ``latest``; add ``--iteration``."""
    @functools.wraps(original)
    def add_training_args(parser):
        parser = original(parser)
        parser.add_argument("--iteration", dest="load_iteration", type=int, default=None, metavar="N",
                            help="with --load: resume from the saved iteration N instead of the one 'latest' "
                                 "names (sat_patches)")
        return parser
    return add_training_args


PATCHES = [
    Patch("resume_optimizer_save", "sat.training.model_io:save_checkpoint", _save_checkpoint,
          answers="resume (stock SAT): SAT's save_ds_checkpoint_no_optim writes no ZeRO optimizer shards; every rank "
                  "now writes DeepSpeed's *_optim_states.pt",
          expect=expect_names("save_ds_checkpoint")),
    Patch("resume_optimizer_load", "sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer",
          _setup_model_and_optimizer,
          answers="resume (stock SAT): SAT's load_checkpoint loads 'only module'; a resumed run's Adam states start at "
                  "zero. Also turns on resume_dataloader when resuming",
          expect=expect_names("initialize")),
    Patch("resume_lr_schedule_state", "sat.training.learning_rates:AnnealingLR.state_dict", _lr_state_dict,
          answers="resume (stock SAT): AnnealingLR.state_dict omits init_step and the auto warm-up, so a resumed "
                  "schedule cannot be rebuilt",
          expect=expect_names("num_iters", "end_iter")),
    Patch("resume_lr_schedule", "sat.training.deepspeed_training:get_learning_rate_scheduler",
          _get_learning_rate_scheduler,
          answers="resume (stock SAT): a resumed run's learning rate restarts 100 iterations back at 5% of the rate "
                  "(auto warm-up) instead of continuing",
          expect=expect_names("AnnealingLR", "warmup", "lr_decay_iters")),
    Patch("resume_rng", "sat.training.deepspeed_training:train", _train,
          answers="resume (stock SAT): training_main re-seeds with --seed after load_checkpoint restored the random "
                  "states; dropout replays the first steps' masks",
          expect=expect_names("train_step")),
    Patch("resume_data_position", "sat.data_utils.configure_data:make_data_loader", _make_data_loader,
          answers="resume (stock SAT): --resume-dataloader's start_iter is read only by DistributedBatchSampler; with "
                  "one data-parallel rank (MP=2 on 2 GPUs) a resumed run re-reads its first batches",
          expect=expect_names("DistributedBatchSampler", "BatchSampler")),
    Patch("resume_iteration_arg", "sat.arguments:add_training_args", _add_training_args,
          answers="resume (stock SAT): --load resumes only from the iteration 'latest' names; --iteration N "
                  "chooses another saved one",
          expect=expect_params("parser")),
]
