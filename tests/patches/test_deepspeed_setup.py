"""DeepSpeed set-up at launch: config lint (each case fixed with a warning or refused with a clear message)."""
import argparse
import copy
import json
import os

import pytest

import sat_patches
from sat_patches.runtime.deepspeed_config import (DeepSpeedConfigError, initialize_distributed_linted,
                                                  lint_deepspeed_config)

# upstream THUDM/CogVLM finetune_demo/test_config_bf16.json (offload_optimizer at the top level)
UPSTREAM_BF16 = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.1,
    "zero_optimization": {"stage": 2, "contiguous_gradients": False, "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 4e7, "allgather_bucket_size": 1e8, "load_from_fp32_weights": False},
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 5e-2}},
}


def lint(config, **kw):
    return lint_deepspeed_config(copy.deepcopy(config), **kw)


@pytest.fixture
def cuda_rank():
    """The device policy of a GPU rank (the lint only asks for the device type)."""
    from sat_patches.runtime import devices
    with devices.use_device("cuda"):
        yield


def test_misplaced_offload_optimizer_moves_into_zero_optimization_where_deepspeed_reads_it(cuda_rank):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    assert DeepSpeedZeroConfig(**UPSTREAM_BF16["zero_optimization"]).offload_optimizer is None  # ignored as shipped
    with pytest.warns(sat_patches.SatPatchesWarning, match="offload_optimizer' was at the top level"):
        fixed = lint(UPSTREAM_BF16)
    assert "offload_optimizer" not in fixed
    assert DeepSpeedZeroConfig(**fixed["zero_optimization"]).offload_optimizer.device == "cpu"


def test_misplaced_offload_is_dropped_on_cpu_ranks():
    with pytest.warns(sat_patches.SatPatchesWarning, match="on CPU ranks offloading to the CPU changes nothing"):
        fixed = lint(UPSTREAM_BF16)
    assert "offload_optimizer" not in fixed and "offload_optimizer" not in fixed["zero_optimization"]
    assert fixed["optimizer"]["params"]["torch_adam"] is True  # no CPU-Adam build either


def test_offload_without_zero_is_refused_with_what_to_change(cuda_rank):
    config = {**copy.deepcopy(UPSTREAM_BF16), "zero_optimization": {"stage": 0}}
    with pytest.raises(DeepSpeedConfigError, match=r"takes effect from ZeRO stage 1 \(this config: stage 0\).*"
                                                   r"Set zero_optimization.stage to 2"):
        lint(config)


def test_offload_param_needs_zero3_and_moves_there(cuda_rank):
    base = {"zero_optimization": {"stage": 2}, "offload_param": {"device": "cpu"}}
    with pytest.raises(DeepSpeedConfigError, match="offload_param.*stage 3"):
        lint(base)
    with pytest.warns(sat_patches.SatPatchesWarning, match="moved into zero_optimization"):
        fixed = lint({**base, "zero_optimization": {"stage": 3}})
    assert fixed["zero_optimization"]["offload_param"] == {"device": "cpu"}


def test_top_level_offload_beside_a_placed_one_is_dropped():
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
              "offload_optimizer": {"device": "cpu"}}
    with pytest.warns(sat_patches.SatPatchesWarning, match="already set"):
        fixed = lint(config)
    assert fixed["zero_optimization"]["offload_optimizer"] == {"device": "none"} and "offload_optimizer" not in fixed


@pytest.mark.parametrize("world, mp, total, ok", [
    (8, 2, 16, True),      # 4 x 1 x (8 / 2)
    (8, 1, 16, False),     # 4 x 1 x 8 = 32
    (8, 2, 32, False),     # would need accumulation 2
])
def test_batch_arithmetic_micro_x_accumulation_x_data_parallel(world, mp, total, ok):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": total}
    if ok:
        assert lint(config, world_size=world, model_parallel_size=mp)["train_batch_size"] == total
        return
    with pytest.raises(DeepSpeedConfigError, match=rf"train_batch_size={total} but train_micro_batch_size_per_gpu=4 x "
                                                   rf"gradient_accumulation_steps=1 x {world // mp} data-parallel"):
        lint(config, world_size=world, model_parallel_size=mp)


def test_batch_arithmetic_lets_deepspeed_derive_accumulation_and_names_the_fix():
    derived = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 16}
    assert "gradient_accumulation_steps" not in lint(derived, world_size=4, model_parallel_size=1)  # 16 = 2 x 2 x 4
    with pytest.raises(DeepSpeedConfigError, match="set gradient_accumulation_steps to 2"):
        lint({**derived, "gradient_accumulation_steps": 1}, world_size=4, model_parallel_size=1)


def test_missing_micro_batch_is_sat_loader_batch_size():
    with pytest.warns(sat_patches.SatPatchesWarning, match="gives each rank 3 samples"):
        fixed = lint({"gradient_accumulation_steps": 1}, world_size=2, model_parallel_size=1, batch_size=3)
    assert fixed["train_micro_batch_size_per_gpu"] == 3


@pytest.mark.parametrize("config, world, mp, message", [
    ({"train_micro_batch_size_per_gpu": 0}, 2, 1, "must be a positive integer"),
    ({"gradient_accumulation_steps": 1.5}, 2, 1, "must be a positive integer"),
    ({}, 6, 4, r"model-parallel size 4 does not divide the 6 ranks.*\[1, 2, 3, 6\]"),
])
def test_impossible_numbers_are_refused(config, world, mp, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        lint(config, world_size=world, model_parallel_size=mp)


def test_min_loss_scale_and_sat_bundled_configs_pass():
    import sat
    folder = os.path.join(os.path.dirname(sat.__file__), "training")
    for name in sorted(os.listdir(folder)):
        if name.startswith("deepspeed_zero") and name.endswith(".json"):
            config = json.load(open(os.path.join(folder, name)))
            config.pop("offload_optimizer", None) if config.get("zero_optimization", {}).get("stage", 0) < 1 else None
            fixed = lint(config, world_size=2, model_parallel_size=1, batch_size=4)
            assert isinstance(fixed.get("fp16", {}).get("min_loss_scale", 1), int), name


def test_lint_runs_at_launch_with_the_run_geometry(cuda_rank):
    """The deepspeed_config_lint patch hands SAT's world size, MP size and --batch-size to the lint."""
    seen = []
    def wrapped(args):
        return initialize_distributed_linted(lambda a: seen.append(a.deepspeed_config) or "initialised", args)
    bad = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 64}
    args = argparse.Namespace(deepspeed_config=dict(bad), world_size=8, model_parallel_size=2, batch_size=4)
    with pytest.raises(DeepSpeedConfigError, match="= 16"):
        wrapped(args)
    assert not seen  # refused before SAT/DeepSpeed started anything
    args.deepspeed_config = {"offload_optimizer": {"device": "cpu"}, "zero_optimization": {"stage": 2}}
    with pytest.warns(sat_patches.SatPatchesWarning, match="moved into zero_optimization"):
        assert wrapped(args) == "initialised"
    assert seen[-1]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_sat_initialize_distributed_refuses_a_bad_config_before_its_own_code():
    import sat.arguments
    bad = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 64}
    args = argparse.Namespace(deepspeed_config=bad, world_size=8, model_parallel_size=2, batch_size=4)
    with pytest.raises(DeepSpeedConfigError, match="Delete train_batch_size"):  # SAT's code would need args.device
        sat.arguments.initialize_distributed(args)  # as patched by sat_patches


def test_fused_adam_builds_with_an_architecture_specific_arch_list(monkeypatch):
    """Hopper images set ``TORCH_CUDA_ARCH_LIST=9.0a``; DeepSpeed's op builder reads it with ``int()`` before
    FusedAdam's JIT build. Patched, the op is built for 9.0 (the environment as DeepSpeed leaves it)."""
    import importlib
    from patching import patches_removed
    builder = importlib.import_module("deepspeed.ops.op_builder.fused_adam").FusedAdamBuilder()
    builder.jit_mode = True  # as jit_load sets it
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    with patches_removed("deepspeed_arch_variants"):
        with pytest.raises(ValueError, match="'0a'"):
            builder.compute_capability_args()
    builder.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"  # what DeepSpeed writes for the list it builds
    builder._jit_arch_list = "9.0a;10.0a+PTX"  # the list jit_load captured
    builder.compute_capability_args()
    assert builder._jit_arch_list == "9.0;10.0+PTX" and os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0;10.0+PTX"


def test_arch_lists_lose_only_their_variant_suffixes():
    from sat_patches.runtime.cuda_arch import without_variants
    assert without_variants("7.5;8.0;8.6+PTX;9.0a;10.0a+PTX;12.0f") == "7.5;8.0;8.6+PTX;9.0;10.0+PTX;12.0"
    assert without_variants("9.0 9.0a") == "9.0 9.0" and without_variants(None) is None and without_variants("") == ""
