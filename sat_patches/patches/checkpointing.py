"""Atomic checkpoint saves (issue 7, item 2).

What SAT 0.4.12 does (``sat/training/model_io.py``): ``save_checkpoint`` has every model-parallel
rank write ``<save>/<N>/mp_rank_XX_model_states.pt`` in place, and ``save_ds_checkpoint_no_optim``
makes every one of them overwrite ``<save>/latest`` with ``N`` right after its own shard is written;
after a barrier rank 0 rewrites ``latest`` and ``model_config.json`` in place. A rank killed during a
save (host OOM, CogVLM 283/320 "kill -9"; preemption) leaves ``latest`` naming an iteration whose
other shards (and LoRA weights, which live in the same files) are missing or truncated: the run can
no longer resume from anything.

Here every rank saves iteration N into ``<save>/.saving-<N>/`` (SAT's own code, unchanged, with
``args.save`` pointing there); all ranks meet; global rank 0 checks that staged directory with
:func:`sat_patches.checkpoints.files.find_checkpoint` (every MP shard present, none truncated), then ONE rename
makes ``<save>/<N>`` appear (an atomic exchange when ``<save>/<N>`` already exists, e.g. SAT's final
save of the last interval's iteration), then ``model_config.json`` and last ``latest`` are replaced
with ``os.replace`` of a fsynced temporary file. A crash at any point leaves ``latest`` naming the
previous complete iteration. Stale ``.saving-*`` directories of a crashed save are removed by the
next save of that iteration.

SAT's EMA check reads ``optimizer.optimizer``, which a bare torch optimizer (DeepSpeed without a ZeRO
wrapper) lacks: such an optimizer is not passed on (SAT uses it for nothing else there).

Assumes ``<save>`` is one filesystem seen by every rank (as SAT's own ``latest`` handling does).
"""
from __future__ import annotations

import copy
import ctypes
import functools
import os
import shutil
import sys

from ..core.registry import Patch, expect_names

STAGING_PREFIX = ".saving-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_dir(save: str, iteration) -> str:
    return os.path.join(save, f"{STAGING_PREFIX}{iteration}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old content or the new, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def publish(staged: str, save: str) -> None:
    """Move a staged save (``<N>`` directories, ``model_config.json``, ``latest``) into ``save``:
    each directory with one rename, then ``model_config.json``, then ``latest`` last."""
    from ..checkpoints.files import find_checkpoint
    find_checkpoint(staged)  # every MP shard present and not truncated, else CheckpointError: keep the old one
    for entry in sorted(os.listdir(staged)):
        src, dst = os.path.join(staged, entry), os.path.join(save, entry)
        if not os.path.isdir(src):
            continue
        if os.path.exists(dst):
            if not _exchange(src, dst):          # no atomic swap: brief window without <save>/<N>
                old = f"{dst}.old-{os.getpid()}"
                os.rename(dst, old)
                os.rename(src, dst)
                shutil.rmtree(old, ignore_errors=True)
            # after an exchange, the old directory sits at src and goes with the staging directory
        else:
            os.rename(src, dst)
    _fsync_dir(save)
    config = os.path.join(staged, "model_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            write_atomic(os.path.join(save, "model_config.json"), f.read())
    with open(os.path.join(staged, "latest")) as f:
        write_atomic(os.path.join(save, "latest"), f.read().strip())
    shutil.rmtree(staged, ignore_errors=True)


def _save_checkpoint(original):
    """SAT's save_checkpoint, staged in ``<save>/.saving-<N>`` and published by one rename on rank 0
    (issue 7 item 2; CogVLM 283/320: ranks killed with kill -9 during a run, here during a save)."""
    @functools.wraps(original)
    def save_checkpoint(iteration, model, optimizer, lr_scheduler, args):
        import torch.distributed as dist
        save = getattr(args, "save", None)
        if not save or not dist.is_initialized():
            return original(iteration, model, optimizer, lr_scheduler, args)
        rank = dist.get_rank()
        staged = staging_dir(save, iteration)
        if rank == 0:
            os.makedirs(save, exist_ok=True)
            shutil.rmtree(staged, ignore_errors=True)  # left by a save that crashed
            os.makedirs(staged)
        dist.barrier()
        if optimizer is not None and not hasattr(optimizer, "optimizer"):
            # SAT reads optimizer.optimizer only to spot FusedEmaAdam; a bare torch optimizer (DeepSpeed
            # with a client optimizer and no ZeRO wrapper) has none: AttributeError after the shards.
            optimizer = None
        staged_args = copy.copy(args)
        staged_args.save = staged
        original(iteration, model, optimizer, lr_scheduler, staged_args)  # ends with a barrier
        if rank == 0:
            publish(staged, save)
        dist.barrier()
    return save_checkpoint


PATCHES = [
    Patch("atomic_checkpoint_save", "sat.training.model_io:save_checkpoint", _save_checkpoint,
          answers="issue 7 item 2 (CogVLM 283/320 kill -9 during a run): a rank killed mid-save left 'latest' "
                  "naming an iteration with missing/truncated MP shards; saves are now staged and renamed",
          expect=expect_names("save_ds_checkpoint", "get_checkpoint_tracker_filename", "barrier")),
]
