"""Simulate a CUDA-only process-group backend (like NCCL) on a CPU machine.

A backend registered with ``devices=["cuda"]`` whose process group is really gloo: CPU tensors
handed to it fail exactly as on an NCCL group, ``No backend type associated with device type cpu``.
"""
import torch.distributed as dist

NAME = "fakenccl"


def register_cuda_only_backend(name: str = NAME) -> str:
    if name.lower() not in dist.Backend.backend_capability:
        def create(store, rank, size, timeout):
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        dist.Backend.register_backend(name, create, devices=["cuda"])
    return name


_barrier_group = None


def simulate_cuda_barrier() -> None:
    """On a real NCCL group ``barrier()`` runs on the CUDA device and succeeds; on the simulated
    CUDA-only group it would pick CPU and fail before SAT's own collectives are reached. Route
    default-group barriers through a side gloo group, as a GPU machine would let them pass."""
    original = dist.barrier
    if getattr(original, "_simulated", False):
        return

    def barrier(group=None, async_op=False, device_ids=None):
        global _barrier_group
        if group is None and NAME in str(dist.get_backend()) and "cpu:" not in str(dist.get_backend()):
            if _barrier_group is None:
                _barrier_group = dist.new_group(backend="gloo")
            return original(group=_barrier_group, async_op=async_op)
        return original(group=group, async_op=async_op, device_ids=device_ids)
    barrier._simulated = True
    dist.barrier = barrier
