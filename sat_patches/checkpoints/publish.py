"""Publishing a staged save: the staging folder of an iteration, and its publication by one rename once every
model-parallel shard is there (the previous checkpoint stays loadable until then).
"""
from __future__ import annotations

import os
import shutil

from ..checkpoints.files import CheckpointError, find_checkpoint, missing_optimizer_shards
from ..checkpoints.writer import replace_dir, write_text_atomic

STAGING_PREFIX = ".saving-"


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
