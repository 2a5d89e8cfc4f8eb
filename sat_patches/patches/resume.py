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

from sat.helpers import check_if_zero3

from ..checkpoints.resume import (SCHEDULE_KEYS, load_optimizer_states, restore_lr_schedule, resumable, resuming,
                                  save_optimizer_states, train_restoring_rng,)
from ..core.registry import Patch, delegate, expect_names, expect_params


def _save_checkpoint(original):
    """SAT saves no ZeRO optimizer shards (``save_ds_checkpoint_no_optim``; CogVLM finetune resume)."""
    @functools.wraps(original)
    def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):
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
    Patch("resume_rng", "sat.training.deepspeed_training:train", delegate(train_restoring_rng),
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
