"""'No backend type associated with device type cpu': reproduced through SAT on CPU with a simulated
CUDA-only backend (like NCCL), and gone with sat_patches."""
import re
import warnings

import pytest
import torch

import sat_patches
from sat_patches import devices
from sat_patches.distributed import process_group_backend, training_device
from sat_patches.testing import run_script
from sat_patches.testing.fake_backend import register_cuda_only_backend

SCRIPT = ["-m", "sat_patches.testing.tiny_lora", "--model-parallel-size", "2", "--cuda-only-backend", "fakenccl"]


def test_backend_policy_gives_cpu_tensors_a_backend():
    register_cuda_only_backend("fakenccl")
    assert process_group_backend("fakenccl") == "cpu:gloo,cuda:fakenccl"
    assert process_group_backend("cuda:fakenccl") == "cpu:gloo,cuda:fakenccl"
    assert process_group_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo") == "gloo"
    # nccl on a machine without CUDA: gloo; with CUDA and NCCL: both
    assert process_group_backend("nccl") == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.multirank
def test_sat_parameter_sync_fails_on_a_cuda_only_group_and_names_the_tensor():
    results = run_script(SCRIPT, nranks=2, timeout=240, patches=["process_group_backend"])
    for r in results:
        assert r.returncode not in (0, None) and not r.timed_out
        assert "RuntimeError: No backend type associated with device type cpu" in r.output
        # the explanation names SAT's call site and a parameter
        assert "Syncing initialized parameters" in r.output and re.search(r"tensor '[\w.]+' is on cpu", r.output)


@pytest.mark.multirank
def test_with_sat_patches_the_same_run_trains():
    results = run_script(SCRIPT, nranks=2, timeout=240)
    for r in results:
        assert r.ok, r.output[-4000:]
    assert "iteration       12/      12" in results[0].output


def test_qlora_demo_cpu_device_is_overridden_when_cuda_computes(monkeypatch):
    class Args:
        device = "cpu"
    monkeypatch.setattr(devices, "compute_device", lambda: torch.device("cuda", 1))
    with pytest.warns(sat_patches.SatPatchesWarning, match="back to CPU"):
        assert training_device(Args(), model_given=True) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert training_device(Args(), model_given=False) == "cpu"  # SAT builds the model itself
