"""SAT's checkpoint saves, made to work on CPU runs, to save only a LoRA run's adapters, and to be atomic (staged,
then published by one rename once every model-parallel shard is there).

Each function takes the place of (or wraps, given as ``original``) one function of ``sat/training/model_io.py``.
SAT functions that other patches replace are looked up through their module (``model_io.<name>``) at call time.
"""
from __future__ import annotations

import copy
import functools
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from sat import mpu
from sat.training import model_io  # save_ds_checkpoint_no_optim looked up at call time: patched or replaced

from ..core.coordination import store_gather
from ..runtime.devices import compute_device
from . import adapter, save_lock
from .files import CheckpointError, find_checkpoint, missing_optimizer_shards
from .state import model_parallel_rng_tracker
from .writer import fsync_tree, replace_dir, write_text_atomic

STAGING_PREFIX = ".saving-"
_saves = [0]  # saves this process has made (names the exchange of each save's staging folder)


class CheckpointSaveError(RuntimeError):
    """A save that could not start (another run saving into the folder, a folder that cannot be written)."""


def staging_dir(save: str, iteration, token: str = "") -> str:
    """Where one run stages its save of ``iteration``: ``<save>/.saving-<N>-<run token>``."""
    return os.path.join(save, f"{STAGING_PREFIX}{iteration}" + (f"-{token}" if token else ""))


def sweep_stale_staging(save: str, keep: str) -> None:
    """Remove the staging folders of earlier saves (crashed, killed, or stopped by a full disk) except
    ``keep``: called by the run that holds the folder's save lock, so no live save owns them."""
    for entry in os.listdir(save):
        path = os.path.join(save, entry)
        if entry.startswith(STAGING_PREFIX) and path != keep and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def publish(staged: str, save: str, world_size: int = 1, mp_size: int = 1) -> None:
    """Move a staged save (``<N>`` directories, ``model_config.json``, ``latest``) into ``save``:
    each directory fsynced and put in place with one rename, then ``model_config.json``, then
    ``latest`` last. Only a complete save is published: every model-parallel shard, and when the
    save holds ZeRO optimizer shards, one for every data-parallel and model-parallel rank; else
    :class:`CheckpointError` names what is missing and ``save`` keeps its previous checkpoint."""
    ckpt = find_checkpoint(staged)  # every MP shard present and not truncated
    folder = os.path.dirname(ckpt.files[0])
    missing = missing_optimizer_shards(folder, max(world_size // mp_size, 1), mp_size)
    if missing:
        raise CheckpointError(f"the save of iteration {ckpt.iteration} lacks {', '.join(missing)} in {folder}: not "
                              f"published; '{save}' keeps its previous checkpoint")
    for entry in sorted(os.listdir(staged)):
        src = os.path.join(staged, entry)
        if os.path.isdir(src):
            replace_dir(src, os.path.join(save, entry))
    config = os.path.join(staged, "model_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            write_text_atomic(os.path.join(save, "model_config.json"), f.read())
    with open(os.path.join(staged, "latest")) as f:
        write_text_atomic(os.path.join(save, "latest"), f.read().strip())
    shutil.rmtree(staged, ignore_errors=True)


def save_ds_checkpoint(iteration, model, lr_scheduler, args, use_ema=False) -> None:
    """SAT's ``save_ds_checkpoint``, saving the CUDA random state only where the device is CUDA, and the
    model-parallel RNG tracker's states, which SAT's ``load_checkpoint`` restores."""
    sd = {"iteration": iteration}
    if lr_scheduler is not None:
        sd["client_lr_scheduler"] = lr_scheduler.state_dict()
    if not args.no_save_rng:
        sd["random_rng_state"] = random.getstate()
        sd["np_rng_state"] = np.random.get_state()
        sd["torch_rng_state"] = torch.get_rng_state()
        if compute_device().type == "cuda":
            sd["cuda_rng_state"] = torch.cuda.get_rng_state()
        tracker = model_parallel_rng_tracker()
        if tracker is not None:  # SAT's load_checkpoint reads these back; its save never wrote them
            sd["rng_tracker_states"] = tracker.get_states()
    tag = f"{iteration}-ema" if use_ema else str(iteration)
    model_io.save_ds_checkpoint_no_optim(model, args.save, tag, client_state=sd)


def save_adapter_only(original, model, save_dir, tag=None, client_state={}, save_latest=True):  # noqa: B006
    """SAT's ``save_ds_checkpoint_no_optim`` (``original``); when :func:`.adapter.adapter_only` says so, with
    DeepSpeed asked for the trained parameters only and ``adapter.json`` naming the base checkpoint."""
    module = getattr(model, "module", model)
    if model.zero_optimization_partition_weights() or not adapter.adapter_only(module):
        return original(model, save_dir, tag, client_state=client_state, save_latest=save_latest)
    base = getattr(module, adapter.BASE_ATTRIBUTE)
    model._save_checkpoint = functools.partial(type(model)._save_checkpoint, model, exclude_frozen_parameters=True)
    try:
        result = original(model, save_dir, tag, client_state=client_state, save_latest=save_latest)
    finally:
        del model._save_checkpoint
    if dist.get_rank() == 0:
        adapter.write_manifest(os.path.join(save_dir, str(tag)), base)
    return result


def save_checkpoint_staged(original, iteration, model, optimizer, lr_scheduler, args) -> None:
    """SAT's ``save_checkpoint`` (``original``): rank 0 takes the folder's save lock; every rank saves into
    ``<save>/.saving-<N>-<run>`` and fsyncs it; rank 0 publishes it (:func:`publish`). Without
    ``args.save`` or a process group, SAT's own save."""
    save = getattr(args, "save", None)
    if not save or not dist.is_initialized():
        return original(iteration, model, optimizer, lr_scheduler, args)
    rank = dist.get_rank()
    verdict = ""
    if rank == 0:  # the run's lock on the folder, then a staging folder of its own
        try:
            os.makedirs(save, exist_ok=True)
            token = save_lock.acquire(save)
            staged = staging_dir(save, iteration, token)
            sweep_stale_staging(save, keep=staged)
            shutil.rmtree(staged, ignore_errors=True)
            os.makedirs(staged)
            verdict = "ok " + token
        except (OSError, save_lock.SaveLockError) as exc:
            verdict = f"error {type(exc).__name__}: {exc}"
    _saves[0] += 1
    verdict = store_gather(f"save/{iteration}/{_saves[0]}", verdict)[0]
    if verdict.startswith("error "):
        raise CheckpointSaveError(f"checkpoint of iteration {iteration} not saved into '{save}': {verdict[6:]}")
    staged = staging_dir(save, iteration, verdict[3:])
    if optimizer is not None and not hasattr(optimizer, "optimizer"):
        # SAT reads optimizer.optimizer only to spot FusedEmaAdam; a bare torch optimizer (DeepSpeed
        # with a client optimizer and no ZeRO wrapper) has none: AttributeError after the shards.
        optimizer = None
    staged_args = copy.copy(args)
    staged_args.save = staged
    try:
        original(iteration, model, optimizer, lr_scheduler, staged_args)  # ends with a barrier
        fsync_tree(staged)  # every rank: the files it wrote are durable (on its node) before publishing
        dist.barrier()
        if rank == 0:
            publish(staged, save, dist.get_world_size(), mpu.get_model_parallel_world_size())
    except BaseException:
        if rank == 0:  # a full disk, a failed write: nothing left behind (one remover: removals by several
            shutil.rmtree(staged, ignore_errors=True)  # ranks at once raced, and one could leave the folder)
        raise
    dist.barrier()
