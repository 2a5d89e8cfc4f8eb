"""Saves and exact resume. A run continued with ``--mode pretrain --load <run>`` gives the losses the uninterrupted
run would have given (optimizer shards, learning-rate schedule, random states, data position:
:mod:`sat_patches.checkpoints.resume`; ZeRO-3 runs keep SAT's own save and load). Saves are atomic (a rank killed
during a save leaves the previous checkpoint loadable) and a LoRA run's hold its adapters
(:mod:`sat_patches.checkpoints.saving`).
"""
from __future__ import annotations

import functools

from sat.helpers import check_if_zero3

from ..checkpoints.resume import (SCHEDULE_KEYS, load_optimizer_states, restore_lr_schedule, resumable, resuming,
                                  save_optimizer_states, train_restoring_rng,)
from ..checkpoints.saving import save_adapter_only, save_checkpoint_staged
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
    """``start_iter`` (``--resume-dataloader``) is ignored with one data-parallel rank: plain BatchSampler. Its
    replacement skips ``start_iter`` iterations of ``gradient_accumulation_steps`` micro-batches each."""
    @functools.wraps(original)
    def make_data_loader(dataset, batch_size, args, split, collate_fn=None):
        loader = original(dataset, batch_size, args, split, collate_fn=collate_fn)
        return resumable(loader, getattr(args, "gradient_accumulation_steps", None) or 1) if split == "train" else loader
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
    Patch("save_adapter_only", "sat.training.model_io:save_ds_checkpoint_no_optim", delegate(save_adapter_only),
          answers="THUDM/CogVLM#303, THUDM/CogVideo#244: every save of a LoRA run holds the whole model; now its "
                  "adapters and a manifest naming the base",
          expect=expect_names("_save_checkpoint")),
    Patch("atomic_checkpoint_save", "sat.training.model_io:save_checkpoint", delegate(save_checkpoint_staged),
          answers="THUDM/CogVLM#283, #320 (ranks killed with kill -9): a rank killed mid-save left 'latest' "
                  "naming an iteration with missing/truncated MP shards; saves are now staged and renamed",
          expect=expect_names("save_ds_checkpoint", "get_checkpoint_tracker_filename", "barrier")),
]
