"""The patches that remove SAT's hard-coded CUDA calls; what they do is in :mod:`sat_patches.runtime.devices`,
:mod:`sat_patches.runtime.collectives` and :mod:`sat_patches.checkpoints.saving`.

The device policy they follow (:mod:`sat_patches.runtime.devices`): the compute device is ``cuda:<LOCAL_RANK>``
when CUDA is available, else ``cpu``; a ``LOCAL_RANK`` beyond the GPUs the node sees is an error, not a second
rank on the same GPU. Every rank of a job must agree (checked when the process group is created,
:func:`sat_patches.runtime.distributed.check_ranks_agree_on_device`). Tests (or ``SAT_PATCHES_DEVICE=meta``)
point it elsewhere with :func:`sat_patches.runtime.devices.use_device` to prove that allocations follow it
instead of a hard-coded device.
"""
from __future__ import annotations

import functools

from ..checkpoints import saving
from ..core.registry import Patch, delegate, expect_names
from ..runtime import collectives
from ..runtime.devices import start_timer, stop_timer


def _timer_method(original):
    """Timers call ``torch.cuda.synchronize`` unconditionally (sat/training/utils.py)."""
    timed = start_timer if original.__name__ == "start" else stop_timer

    @functools.wraps(original)
    def method(self):
        return timed(self)
    return method


PATCHES = [
    Patch("timers_cuda_sync", "sat.training.utils:Timers.Timer.start", _timer_method,
          answers="CPU runs: Timer.start calls torch.cuda.synchronize (sat/training/utils.py)",
          expect=expect_names("cuda", "synchronize")),
    Patch("timers_cuda_sync_stop", "sat.training.utils:Timers.Timer.stop", _timer_method,
          answers="CPU runs: Timer.stop calls torch.cuda.synchronize (sat/training/utils.py)",
          expect=expect_names("cuda", "synchronize")),
    Patch("save_rng_without_cuda", "sat.training.model_io:save_ds_checkpoint",
          delegate(saving.save_ds_checkpoint, with_original=False),
          answers="CPU runs: every checkpoint save calls torch.cuda.get_rng_state() unless --no-save-rng",
          expect=expect_names("get_rng_state", "save_ds_checkpoint_no_optim")),
    Patch("broadcast_data_device", "sat.mpu.data:broadcast_data",
          delegate(collectives.broadcast_data, with_original=False),
          answers="sat/mpu/data.py broadcast_data hard-codes torch.cuda.current_device()",
          expect=expect_names("_build_key_size_numel_dictionaries", "broadcast")),
]
