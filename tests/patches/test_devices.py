"""SAT's CPU gaps, one test each: passes with the patch, fails (and shows how) without it."""
import json
import os

import pytest
import torch

import sat_patches
from multirank import run_ranks
from patching import patches_removed

TRAIN_ARGS = ["--mode", "finetune", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
              "--vocab-size", "1024", "--train-iters", "1", "--batch-size", "1"]


def get_args_on_rank():
    import sat
    args = sat.get_args(list(TRAIN_ARGS))
    return {"device": args.device, "local_rank": args.local_rank, "backend": str(torch.distributed.get_backend()),
            "min_loss_scale": args.deepspeed_config["fp16"]["min_loss_scale"],
            "torch_adam": args.deepspeed_config["optimizer"]["params"].get("torch_adam")}


def test_get_args_trains_on_cpu_with_gloo_and_a_valid_deepspeed_config():
    [r] = run_ranks(get_args_on_rank, 1, timeout=120)
    assert r.ok, r.output[-3000:]
    assert r.result == {"device": "cpu", "local_rank": 0, "backend": "gloo", "min_loss_scale": 1, "torch_adam": True}


@pytest.mark.parametrize("disabled, message", [
    ("get_args_cpu_device", "LOCAL_RANK (default 0) and args.device inconsistent"),
    ("process_group_backend", "NCCL"),
    ("deepspeed_config_lint", "min_loss_scale"),
])
@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
def test_get_args_fails_without_each_patch(disabled, message):
    [r] = run_ranks(get_args_on_rank, 1, timeout=120, patches=[disabled])
    assert not r.ok and message in (r.exception or r.output), (r.exception or r.output)[-3000:]


def test_timers_do_not_call_cuda_synchronize_on_cpu():
    from sat.training.utils import Timers
    timers = Timers()
    timers("step").start()
    timers("step").stop()
    assert timers("step").elapsed() >= 0
    with patches_removed("timers_cuda_sync", "timers_cuda_sync_stop"):
        with pytest.raises(AssertionError, match="not compiled with CUDA"):
            Timers()("step").start()


def broadcast_on_rank():
    import torch.distributed as dist
    from sat import mpu
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(2)
    data = {"tokens": torch.arange(12).view(3, 4), "mask": torch.ones(3, 4, dtype=torch.int64)}
    if dist.get_rank() != 0:
        data = None
    out = mpu.broadcast_data(["tokens", "mask"], data, torch.int64)
    return {k: v.tolist() for k, v in out.items()}


@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
def test_broadcast_data_on_cpu_ranks():
    results = run_ranks(broadcast_on_rank, 2, timeout=120)
    assert all(r.ok for r in results), results[0].output[-3000:]
    for r in results:
        assert r.result["tokens"] == torch.arange(12).view(3, 4).tolist()
        assert r.result["mask"] == [[1] * 4] * 3
    stock = run_ranks(broadcast_on_rank, 2, timeout=120, patches=["broadcast_data_device"])
    assert not any(r.ok for r in stock)
    assert any("CUDA" in (r.exception or "") for r in stock), stock[0].output[-2000:]


def test_deepspeed_config_lint_fixes_sat_bundled_config():
    import sat
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from sat_patches.runtime.deepspeed_config import lint_deepspeed_config
    path = os.path.join(os.path.dirname(sat.__file__), "training", "deepspeed_zero0.json")
    config = json.load(open(path))
    with pytest.raises(Exception, match="min_loss_scale"):
        DeepSpeedFP16Config(**config["fp16"])
    with pytest.warns(sat_patches.SatPatchesWarning, match="min_loss_scale"):
        lint_deepspeed_config(config)
    assert DeepSpeedFP16Config(**config["fp16"]).min_loss_scale == 1
    assert config["optimizer"]["params"]["torch_adam"] is True  # no g++ FusedAdam build on CPU


def test_deepspeed_shm_op_is_not_built_on_cpu(monkeypatch):
    import importlib
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch attr is torch
    built = []

    class Accelerator:
        def create_op_builder(self, name):
            built.append(name)
            return None
    monkeypatch.setattr(ds_torch, "get_accelerator", lambda: Accelerator())
    assert ds_torch.build_shm_op() is None and built == []
    with patches_removed("deepspeed_no_shm_build"):
        ds_torch.build_shm_op()
    assert built == ["ShareMemCommBuilder"]


def test_checkpoint_save_keeps_rng_states_without_cuda(monkeypatch, tmp_path):
    import argparse
    import sat.training.model_io as model_io
    saved = {}
    monkeypatch.setattr(model_io, "save_ds_checkpoint_no_optim",
                        lambda model, save_dir, tag, client_state: saved.update(tag=tag, **client_state))
    args = argparse.Namespace(no_save_rng=False, save=str(tmp_path))
    model_io.save_ds_checkpoint(3, model=None, lr_scheduler=None, args=args)
    assert saved["tag"] == "3" and "torch_rng_state" in saved and "np_rng_state" in saved
    assert "cuda_rng_state" not in saved
    with patches_removed("save_rng_without_cuda"):
        with pytest.raises(AssertionError, match="not compiled with CUDA"):
            model_io.save_ds_checkpoint(3, model=None, lr_scheduler=None, args=args)


def test_model_parallel_rng_tracker_states_are_saved_and_restored(monkeypatch, tmp_path):
    """On CUDA, SAT forks DeepSpeed's model-parallel RNG tracker for attention dropout; its
    load_checkpoint restores ``rng_tracker_states`` but its save never writes them. The round trip on
    the tracker object (with CPU generator states: the object does not care)."""
    import argparse
    import torch
    from deepspeed.runtime.activation_checkpointing.checkpointing import CudaRNGStatesTracker
    from sat import mpu
    from sat.training import model_io
    from sat_patches.checkpoints.state import restore_rng
    from patching import patches_removed
    tracker = CudaRNGStatesTracker()
    torch.manual_seed(7)
    tracker.states_ = {"model-parallel-rng": torch.get_rng_state()}
    monkeypatch.setattr(mpu, "get_cuda_rng_tracker", lambda: tracker)
    saved = {}
    monkeypatch.setattr(model_io, "save_ds_checkpoint_no_optim",
                        lambda model, save, tag=None, client_state=None, **kw: saved.update(client_state))
    args = argparse.Namespace(no_save_rng=False, save=str(tmp_path))
    model_io.save_ds_checkpoint(4, None, None, args)
    at_save = saved["rng_tracker_states"]["model-parallel-rng"].clone()
    torch.manual_seed(8)
    tracker.states_ = {"model-parallel-rng": torch.get_rng_state()}  # the run moved on
    restore_rng(saved)
    assert torch.equal(tracker.get_states()["model-parallel-rng"], at_save)
    saved.clear()
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: torch.get_rng_state())  # stock SAT needs CUDA's
    with patches_removed("save_rng_without_cuda"):
        model_io.save_ds_checkpoint(4, None, None, args)
    assert "torch_rng_state" in saved and "rng_tracker_states" not in saved
