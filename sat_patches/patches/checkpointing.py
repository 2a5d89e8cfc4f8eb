"""Atomic checkpoint saves: a rank killed during a save leaves the previous checkpoint loadable.

What SwissArmyTransformer 0.4.12 does (``sat/training/model_io.py``): ``save_checkpoint`` has every
model-parallel rank write ``<save>/<N>/mp_rank_XX_model_states.pt`` in place, and
``save_ds_checkpoint_no_optim`` makes every one of them overwrite ``<save>/latest`` with ``N`` right
after its own shard is written; after a barrier rank 0 rewrites ``latest`` and ``model_config.json``
in place. A rank killed during a save (host OOM as in THUDM/CogVLM#283 and THUDM/CogVLM#320,
"kill -9"; preemption) leaves ``latest`` naming an iteration whose other shards (and LoRA weights,
which live in the same files) are missing or truncated: the run can no longer resume from anything.

Here global rank 0 first takes the folder's save lock (:mod:`sat_patches.checkpoints.save_lock`: a
second live run saving into the same folder is refused) and sweeps the staging folders earlier saves
left (a crash, a full disk); every rank saves iteration N into ``<save>/.saving-<N>-<run>/`` (SAT's own
code, unchanged, with ``args.save`` pointing there; ``<run>`` is rank 0's host and process id) and
fsyncs what it wrote; all ranks meet; global rank 0 checks that staged directory with
:func:`sat_patches.checkpoints.files.find_checkpoint` (every MP shard present, none truncated), then ONE rename
makes ``<save>/<N>`` appear (an atomic exchange when ``<save>/<N>`` already exists, e.g. SAT's final
save of the last interval's iteration), then ``model_config.json`` and last ``latest`` are replaced
with ``os.replace`` of a fsynced temporary file (:mod:`sat_patches.checkpoints.writer`, which fsyncs
every staged file before the rename). A crash at any point leaves ``latest`` naming the
previous complete iteration. A save that fails (e.g. ENOSPC) removes its staging folder.

SAT's EMA check reads ``optimizer.optimizer``, which a bare torch optimizer (DeepSpeed without a ZeRO
wrapper) lacks: such an optimizer is not passed on (SAT uses it for nothing else there).

Assumes ``<save>`` is one filesystem seen by every rank (as SAT's own ``latest`` handling does).
"""
from __future__ import annotations

import copy
import functools
import os
import shutil

import torch.distributed as dist
from sat import mpu

from ..checkpoints import save_lock
from ..checkpoints.publish import CheckpointSaveError, publish, staging_dir, sweep_stale_staging
from ..checkpoints.writer import fsync_tree
from ..core.coordination import store_gather
from ..core.registry import Patch, expect_names

_saves = [0]  # saves this process has made (names the exchange of each save's staging folder)


def _save_checkpoint(original):
    """SAT's save_checkpoint, staged in ``<save>/.saving-<N>-<run>`` and published by one rename on rank 0
    (stock SAT writes shards and ``latest`` in place: a rank killed mid-save, as the kill -9 of
    THUDM/CogVLM#283 and THUDM/CogVLM#320 during a save, leaves no checkpoint to resume from)."""
    @functools.wraps(original)
    def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):
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
    return save_checkpoint


PATCHES = [
    Patch("atomic_checkpoint_save", "sat.training.model_io:save_checkpoint", _save_checkpoint,
          answers="THUDM/CogVLM#283, #320 (ranks killed with kill -9): a rank killed mid-save left 'latest' "
                  "naming an iteration with missing/truncated MP shards; saves are now staged and renamed",
          expect=expect_names("save_ds_checkpoint", "get_checkpoint_tracker_filename", "barrier")),
]
