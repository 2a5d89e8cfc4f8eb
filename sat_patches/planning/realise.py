"""What realises a planned :class:`~.memory.Setup`: its DeepSpeed config, trainer options and script settings."""
from __future__ import annotations

from typing import Dict, List

from .memory import Setup
from .search import UPSTREAM_RANK_BATCH


def deepspeed_config(s: Setup) -> dict:
    """A DeepSpeed config realising ``s`` in upstream's style (finetune_demo/test_config_bf16.json),
    with ``offload_optimizer`` inside ``zero_optimization`` where DeepSpeed reads it."""
    config = {"train_batch_size": s.global_batch, "train_micro_batch_size_per_gpu": s.micro_batch,
              "gradient_accumulation_steps": s.accumulation, "gradient_clipping": 0.1}
    if s.zero:
        zero = {"stage": s.zero, "contiguous_gradients": False, "overlap_comm": True, "reduce_scatter": True,
                "reduce_bucket_size": s.reduce_bucket, "allgather_bucket_size": s.allgather_bucket,
                "load_from_fp32_weights": False}
        if s.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_optimization"] = zero
        config["zero_allow_untested_optimizer"] = True
    config["bf16"] = {"enabled": s.dtype == "bf16"}
    if s.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "min_loss_scale": 1}
    config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 5e-2}}
    return config


def checkpoint_options(s: Setup) -> List[str]:
    """The trainer options realising ``s``'s checkpointing (language model and EVA)."""
    if not s.checkpoint_activations:
        return []
    skip = ["--checkpoint-skip-layers", str(s.checkpoint_skip_layers)] if s.checkpoint_skip_layers else []
    return ["--checkpoint-activations", "--vit_checkpoint_activations", *skip]


def script_settings(s: Setup) -> Dict[str, str]:
    """Environment of upstream's finetune_*_lora.sh that realises ``s``."""
    settings = {"NUM_GPUS_PER_WORKER": str(s.gpus), "MP_SIZE": str(s.mp), "LOCAL_WORLD_SIZE": str(s.gpus)}
    if s.global_batch != UPSTREAM_RANK_BATCH * s.dp:  # the scripts' default is upstream's
        settings["GLOBAL_BATCH"] = str(s.global_batch)
    if s.qlora:
        settings["QLORA"] = "1"
    if not s.checkpoint_activations:
        settings["CHECKPOINT_ACTIVATIONS"] = "0"
    elif s.checkpoint_skip_layers:
        settings["CHECKPOINT_SKIP_LAYERS"] = str(s.checkpoint_skip_layers)
    settings.update(lever_settings(s))
    return settings


def lever_settings(s: Setup) -> Dict[str, str]:
    """The sat_patches settings of ``s``'s levers: its share of selectively checkpointed layers, compiled layers."""
    out = {}
    if s.checkpoint_activations and s.selective_share:
        out["SAT_PATCHES_CHECKPOINT_SELECTIVE"] = f"{s.selective_share:.4g}"
    if s.compiled:
        out["SAT_PATCHES_COMPILE_LAYERS"] = "1"
    return out
