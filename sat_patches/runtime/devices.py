"""The device policy: where a rank's new tensors belong (``cuda:<LOCAL_RANK>``, else ``cpu``; :func:`use_device`
or ``SAT_PATCHES_DEVICE`` point it elsewhere), the device its collectives use, a CUDA synchronize only on CUDA.
More ranks than GPUs is an error, except in the debugging mode ``SAT_PATCHES_SHARED_GPU=1``.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Optional

import torch

from ..core import settings

_override: Optional[torch.device] = None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def compute_device() -> torch.device:
    """Where new tensors of this rank belong."""
    if _override is not None:
        return _override
    env = settings.read("SAT_PATCHES_DEVICE")
    if env:
        return torch.device(env)
    if cuda_available():
        count = torch.cuda.device_count()
        if shared_gpu():
            return torch.device("cuda", local_rank() % count)
        if local_rank() >= count:  # a modulo would silently put two ranks on one GPU
            raise RuntimeError(f"sat_patches: LOCAL_RANK={local_rank()} but {describe()}: this node runs more ranks "
                               f"than it has GPUs. Lower the GPUs per node (NUM_GPUS_PER_WORKER / --nproc-per-node) "
                               f"to {count}, or make more GPUs visible (to debug several ranks on one GPU: "
                               f"SAT_PATCHES_SHARED_GPU=1).")
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def local_world_size() -> int:
    """The ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, DeepSpeed's launcher's ``LOCAL_SIZE``, else
    ``WORLD_SIZE`` (one node)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def shared_gpu() -> bool:
    """``SAT_PATCHES_SHARED_GPU=1``: the node's ranks share its GPUs, their collectives through the host relay;
    refused where each rank has a card of its own."""
    if not settings.read("SAT_PATCHES_SHARED_GPU"):
        return False
    count = torch.cuda.device_count() if cuda_available() else 0
    if count and local_world_size() <= count:
        raise RuntimeError(f"sat_patches: SAT_PATCHES_SHARED_GPU=1 lets several ranks share a GPU, but this node "
                           f"runs {local_world_size()} rank(s) and {describe()}: each rank has a card of its own. "
                           f"Unset SAT_PATCHES_SHARED_GPU (a debugging mode: its collectives go through host "
                           f"copies) and the ranks use NCCL.")
    return True


def describe() -> str:
    """What this rank sees, for messages: host, CUDA devices, CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    count = torch.cuda.device_count() if cuda_available() else 0
    return f"host {socket.gethostname()} sees {count} CUDA device(s) (CUDA_VISIBLE_DEVICES {shown})"


def communication_device() -> torch.device:
    """Device for tensors handed to collectives: the compute device, or CPU when that is meta."""
    dev = compute_device()
    return torch.device("cpu") if dev.type == "meta" else dev


@contextlib.contextmanager
def use_device(device):
    """Point the policy at ``device`` (e.g. ``"meta"``) inside the block."""
    global _override
    previous, _override = _override, torch.device(device)
    try:
        yield _override
    finally:
        _override = previous


def synchronize() -> None:
    """``torch.cuda.synchronize`` only where the compute device is CUDA."""
    if compute_device().type == "cuda":
        torch.cuda.synchronize()


def start_timer(timer) -> None:
    """SAT's ``Timers.Timer.start`` calls ``torch.cuda.synchronize`` unconditionally, failing on CPU runs."""
    assert not timer.started_, "timer has already been started"
    synchronize()
    timer.start_time = time.time()
    timer.started_ = True


def stop_timer(timer) -> None:
    """SAT's ``Timers.Timer.stop`` (sat/training/utils.py): :func:`start_timer`'s counterpart."""
    assert timer.started_, "timer is not started"
    synchronize()
    timer.elapsed_ += time.time() - timer.start_time
    timer.started_ = False
