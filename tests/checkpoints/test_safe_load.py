"""A checkpoint with a pickle payload: no loading path of sat_patches runs it; each names what it refused."""
import os

import pytest
import torch

from sat_patches.checkpoints import safe_load
from multirank import run_ranks
from payload import plant


def tiny_checkpoint(path, marker):
    import expert_llama as el
    cfg = el.config(num_layers=1, hidden_size=32, inner_hidden_size=64)
    model = el.model_class()(el.build_args(cfg))
    el.write_checkpoint(model, cfg, str(path))
    plant(os.path.join(str(path), "1", "mp_rank_00_model_states.pt"), marker)
    return cfg


def _refused(exc_info, marker):
    message = str(exc_info.value)
    assert "system" in message and safe_load.TRUST_ENV in message, message  # names the type and the opt-in
    assert not os.path.exists(marker)


def test_from_pretrained_at_mp1_refuses_and_trusting_runs_it(tmp_path, monkeypatch):
    import expert_llama as el
    marker = str(tmp_path / "ran")
    cfg = tiny_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(safe_load.UnsafeCheckpointError) as exc:
        el.model_class().from_pretrained(str(tmp_path / "ckpt"), el.build_args(cfg))
    _refused(exc, marker)
    monkeypatch.setenv(safe_load.TRUST_ENV, "1")  # the payload is real: trusted, the file runs it
    el.model_class().from_pretrained(str(tmp_path / "ckpt"), el.build_args(cfg))
    assert os.path.exists(marker)


def test_merge_refuses_before_writing_anything(tmp_path):
    from sat_patches.checkpoints.merge import merge
    marker = str(tmp_path / "ran")
    tiny_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(safe_load.UnsafeCheckpointError) as exc:
        merge(str(tmp_path / "ckpt"), str(tmp_path / "merged"), imports=("expert_llama",))
    _refused(exc, marker)
    assert not (tmp_path / "merged").exists()


def _load_at_mp2(ckpt):
    import torch.distributed as dist
    from sat import mpu
    from sat_patches.checkpoints.model_config import read_model_config
    import expert_llama as el
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(2)
    try:
        el.model_class().from_pretrained(ckpt, el.build_args(read_model_config(ckpt), model_parallel_size=2))
    except safe_load.UnsafeCheckpointError as exc:
        return str(exc)
    finally:
        # rank 0 holds the rendezvous store: leaving first would cut off a rank still creating its groups
        # (seen: rank 1 "Failed to recv ... Connection was likely closed" inside initialize_model_parallel)
        dist.barrier()
    return None


@pytest.mark.slow  # end to end on CPU ranks (over 10 s)
@pytest.mark.multirank
def test_from_pretrained_at_mp2_refuses_on_every_rank(tmp_path):
    marker = str(tmp_path / "ran")
    tiny_checkpoint(tmp_path / "ckpt", marker)
    results = run_ranks(_load_at_mp2, 2, args=(str(tmp_path / "ckpt"),), timeout=120)
    for r in results:
        assert r.result and "system" in r.result, r.output[-3000:]
    assert not os.path.exists(marker)


def test_an_fp16_zero_shards_dynamic_loss_scaler_loads_safely_and_only_because_it_is_allowed(tmp_path, monkeypatch):
    """fp16 ZeRO optimizer shards pickle DeepSpeed's ``DynamicLossScaler`` (the state resume needs); built here
    directly, since DeepSpeed trains fp16 on CPU ranks only where the CPU has AVX512-FP16."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    path = str(tmp_path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    scaler = DynamicLossScaler(init_scale=2 ** 12, scale_window=100, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler, "dynamic_loss_scale": True}}, path)
    loaded = safe_load.load(path)["optimizer_state_dict"]["loss_scaler"]
    assert isinstance(loaded, DynamicLossScaler) and loaded.cur_scale == 2 ** 12
    name = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    monkeypatch.setattr(safe_load, "ALLOWED", tuple(n for n in safe_load.ALLOWED if n != name))
    with pytest.raises(safe_load.UnsafeCheckpointError, match="DynamicLossScaler"):
        safe_load.load(path)


def test_a_zero3_checkpoints_payload_does_not_run_when_torch_loads_in_full(tmp_path, monkeypatch):
    """SAT loads ZeRO-3 checkpoints with its own ``torch.load`` (no ``weights_only``): in full on torch < 2.6,
    as ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` makes any torch behave."""
    from sat.training.model_io import load_checkpoint
    import expert_llama as el
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.delenv(safe_load.TRUST_ENV, raising=False)
    marker = str(tmp_path / "ran")
    cfg = tiny_checkpoint(tmp_path / "ckpt", marker)
    args = el.build_args(cfg)
    args.mode, args.deepspeed_config = "finetune", {"zero_optimization": {"stage": 3}}
    model = el.model_class()(args)
    with pytest.raises(safe_load.UnsafeCheckpointError) as exc:
        load_checkpoint(model, args, load_path=str(tmp_path / "ckpt"))
    _refused(exc, marker)


def test_deepspeed_universal_checkpoint_loading_is_refused_unless_trusted(monkeypatch):
    from sat_patches.runtime.deepspeed_config import DeepSpeedConfigError, lint_deepspeed_config
    monkeypatch.delenv(safe_load.TRUST_ENV, raising=False)
    config = {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"load_universal": True}}
    with pytest.raises(DeepSpeedConfigError, match=f"load_universal.*{safe_load.TRUST_ENV}=1"):
        lint_deepspeed_config(dict(config))
    monkeypatch.setenv(safe_load.TRUST_ENV, "1")
    assert lint_deepspeed_config(dict(config))["checkpoint"]["load_universal"] is True
