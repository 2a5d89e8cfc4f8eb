"""The patches that remove SAT's hard-coded CUDA calls, following the device policy of
:mod:`sat_patches.runtime.devices` (also :mod:`sat_patches.runtime.collectives`, :mod:`sat_patches.checkpoints.saving`).
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
