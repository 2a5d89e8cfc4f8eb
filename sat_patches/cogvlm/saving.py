"""A model written in SAT's checkpoint layout by every rank, published whole (``--from_pretrained DIR`` loads it)."""
from __future__ import annotations

import os
import shutil

import torch.distributed as dist
from sat import mpu

from ..checkpoints import writer
from ..core.coordination import barrier
from .config import model_config_dict


def save_pretrained_dir(model, args, directory: str, iteration: int = 1) -> str:
    """(every rank) Write ``model`` in SAT's checkpoint layout into a staging directory that rank 0 then
    publishes as ``directory``: replaced as a whole, and only by a complete checkpoint."""
    first = not dist.is_initialized() or dist.get_rank() == 0
    staged = writer.staging_dir_for(directory, shared=True)
    if first:
        shutil.rmtree(staged, ignore_errors=True)  # left by a save that crashed
        os.makedirs(staged)
    barrier(f"staging '{directory}'")
    module = model.module if hasattr(model, "module") else model
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    mp_rank = mpu.get_model_parallel_rank() if mpu.model_parallel_is_initialized() else 0
    writer.write_layout(staged, iteration, {mp_rank: {"module": state, "iteration": iteration}},
                        config=model_config_dict(args) if mp_rank == 0 else None, latest=mp_rank == 0)
    barrier(f"saved a shard of '{directory}'")
    if first:
        try:
            writer.publish_checkpoint_dir(staged, directory)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    barrier(f"saved '{directory}'")
    return directory
