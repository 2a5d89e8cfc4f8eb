"""GPU-only: the CUDA side of the device and backend policies, on the real thing. Skipped on machines
without CUDA (this project's CI); the CPU tests prove the same code paths through the meta policy and a
simulated CUDA-only backend (tests/patches/test_construction.py, tests/patches/test_distributed.py); test_construction.py has the
GPU twin of its meta scenarios."""
import os

import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def test_compute_device_is_cuda_local_rank(monkeypatch):
    from sat_patches.runtime import devices
    monkeypatch.delenv("SAT_PATCHES_DEVICE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count() - 1))
    assert devices.compute_device() == torch.device("cuda", torch.cuda.device_count() - 1)
    assert devices.compute_device().index == torch.cuda.device_count() - 1


def test_nccl_becomes_cpu_gloo_cuda_nccl():
    from sat_patches.runtime.distributed import process_group_backend
    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"


def broadcast_cpu_and_cuda_tensors():
    import torch.distributed as dist
    from sat_patches.runtime.distributed import process_group_backend
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(process_group_backend("nccl"))
    cpu = torch.full((4,), float(dist.get_rank()))
    gpu = torch.full((4,), float(dist.get_rank()), device="cuda")
    dist.broadcast(cpu, src=0)
    dist.broadcast(gpu, src=0)
    return float(cpu.sum()), float(gpu.sum()), dist.get_backend()


@two_gpus
@pytest.mark.multirank
def test_cpu_and_cuda_tensors_both_have_a_backend_on_two_gpus():
    """What stock SAT fails with on 2 GPUs ("No backend type associated with device type cpu")."""
    results = run_ranks(broadcast_cpu_and_cuda_tensors, 2, timeout=120)
    for r in results:
        assert r.result is not None, r.exception or r.output[-3000:]
        assert r.result[:2] == (0.0, 0.0)
