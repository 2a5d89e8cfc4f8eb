"""Collectives SAT runs on a hard-coded CUDA device, on the device policy's communication device instead."""
from __future__ import annotations

import torch
from sat.mpu.initialize import (get_model_parallel_group, get_model_parallel_rank, get_model_parallel_src_rank,
                                get_model_parallel_world_size, model_parallel_is_initialized)

from .devices import communication_device


def broadcast_data(keys, data, datatype):
    """SAT's ``mpu.broadcast_data`` packs the batch on ``torch.cuda.current_device()``, failing on CPU ranks:
    the same broadcast (shapes, then one flat tensor) on the communication device."""
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


def model_parallel_values(value: float):
    """``value`` of every rank of this rank's model-parallel group, in rank order (``[value]`` without model
    parallelism); every rank of the group must call it."""
    size = get_model_parallel_world_size() if model_parallel_is_initialized() else 1
    if size == 1:
        return [float(value)]
    mine = torch.tensor([float(value)], dtype=torch.float64, device=communication_device())
    every = [torch.empty_like(mine) for _ in range(size)]
    torch.distributed.all_gather(every, mine, group=get_model_parallel_group())
    return [float(t) for t in every]
