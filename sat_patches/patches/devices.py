"""The device policy every patch asks, and the patches that remove SAT's hard-coded CUDA calls.

Policy: the compute device is ``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``; a
``LOCAL_RANK`` beyond the GPUs the node sees is an error, not a second rank on the same GPU. Every
rank of a job must agree (checked when the process group is created,
:func:`sat_patches.patches.distributed.check_ranks_agree_on_device`).
Tests (or ``SAT_PATCHES_DEVICE=meta``) point it elsewhere with :func:`use_device` to prove that
allocations follow it instead of a hard-coded device.
"""
from __future__ import annotations

import functools
import random
import time

import numpy as np
import torch
from sat.mpu.initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_src_rank
from sat.training import model_io  # save_ds_checkpoint_no_optim looked up at call time: patched or replaced

from ..checkpoints.state import model_parallel_rng_tracker
from ..core.registry import Patch, expect_names
from ..runtime.devices import communication_device, compute_device, synchronize


def _timer_method(original):
    """Timers call ``torch.cuda.synchronize`` unconditionally (sat/training/utils.py)."""
    timed = original.__name__  # 'start' or 'stop'

    @functools.wraps(original)
    def method(self):
        if timed == "start":
            assert not self.started_, "timer has already been started"
            synchronize()
            self.start_time = time.time()
            self.started_ = True
        else:
            assert self.started_, "timer is not started"
            synchronize()
            self.elapsed_ += time.time() - self.start_time
            self.started_ = False
    return method


def _broadcast_data(original):
    """``mpu.broadcast_data`` packs on ``torch.cuda.current_device()`` (sat/mpu/data.py)."""

    @functools.wraps(original)
    def broadcast_data(keys, data, datatype):
        device = communication_device()
        group, src = get_model_parallel_group(), get_model_parallel_src_rank()
        if get_model_parallel_rank() == 0:
            for key in keys:
                if data[key].dtype != datatype:
                    raise TypeError(f"broadcast_data: {key} has data type {data[key].dtype}, "
                                    f"expected {datatype}")
            shapes = [list(data[key].shape) for key in keys]
        else:
            shapes = None
        box = [shapes]
        torch.distributed.broadcast_object_list(box, src=src, group=group, device=device)
        shapes = box[0]
        numels = [int(torch.Size(s).numel()) for s in shapes]
        if get_model_parallel_rank() == 0:
            flat = torch.cat([data[k].contiguous().view(-1) for k in keys]).to(device)
        else:
            flat = torch.empty(sum(numels), dtype=datatype, device=device)
        torch.distributed.broadcast(flat, src, group=group)
        out, offset = {}, 0
        for key, shape, numel in zip(keys, shapes, numels):
            out[key] = flat.narrow(0, offset, numel).view(shape)
            offset += numel
        return out
    return broadcast_data


def _save_ds_checkpoint(original):
    """sat/training/model_io.py save_ds_checkpoint: ``torch.cuda.get_rng_state()`` on every save (CPU
    runs), and the model-parallel RNG tracker's states, which SAT's ``load_checkpoint`` restores but
    its save never wrote (a resumed CUDA run re-drew its attention-dropout masks)."""


    @functools.wraps(original)
    def save_ds_checkpoint(iteration, model, lr_scheduler, args, use_ema=False):
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
    return save_ds_checkpoint


PATCHES = [
    Patch("timers_cuda_sync", "sat.training.utils:Timers.Timer.start", _timer_method,
          answers="CPU runs: Timer.start calls torch.cuda.synchronize (sat/training/utils.py)",
          expect=expect_names("cuda", "synchronize")),
    Patch("timers_cuda_sync_stop", "sat.training.utils:Timers.Timer.stop", _timer_method,
          answers="CPU runs: Timer.stop calls torch.cuda.synchronize (sat/training/utils.py)",
          expect=expect_names("cuda", "synchronize")),
    Patch("save_rng_without_cuda", "sat.training.model_io:save_ds_checkpoint", _save_ds_checkpoint,
          answers="CPU runs: every checkpoint save calls torch.cuda.get_rng_state() unless --no-save-rng",
          expect=expect_names("get_rng_state", "save_ds_checkpoint_no_optim")),
    Patch("broadcast_data_device", "sat.mpu.data:broadcast_data", _broadcast_data,
          answers="sat/mpu/data.py broadcast_data hard-codes torch.cuda.current_device()",
          expect=expect_names("_build_key_size_numel_dictionaries", "broadcast")),
]
