"""Model configurations: upstream's published ``model_config.json`` fields, the tiny stand-in, and
reading/writing the SAT checkpoint folder layout (``model_config.json``, ``latest``,
``<iteration>/mp_rank_XX_model_states.pt``) that ``--from_pretrained <dir>`` loads.

Field names and order follow the released SAT checkpoints (cogagent-chat's ``model_config.json``
as published; cogvlm-base-490's fields are the same minus the cross-attention branch, with 490 px
images: ``image_length`` 1225 = (490/14)^2, EVA ``max_sequence_length`` 1226).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
from typing import Optional

from .shapes import EVA_E_ARGS, UPSTREAM_CONFIGS  # noqa: F401  (the one table of model shapes)

# The order in which model_config.json lists its fields (upstream's); other fields follow.
CONFIG_FIELDS = [
    "model_class", "tokenizer_type", "text_processor_version", "num_layers", "hidden_size",
    "num_attention_heads", "vocab_size", "layernorm_order", "model_parallel_size", "max_sequence_length",
    "is_decoder", "cross_attn_hidden_size", "use_bias", "inner_hidden_size",
    "cross_hidden_size_per_attention_head", "encoder_args", "image_length", "cross_image_pix", "eva_args",
    "use_neft_noise", "bos_token_id", "eos_token_id", "pad_token_id",
]

TINY_TOKENIZER_TYPE = "sat_patches-tiny-captcha"
TINY_MAX_LENGTH = 80  # room for bos + 18 image slots + prompt + label + eos, plus upstream's 50-token margin


def tiny_config(kind: str = "cogvlm") -> dict:
    """The tiny stand-in's ``model_config.json`` content: LLaMA 2x128 (4 heads, vocab 1024), EVA
    2x64 on 56x56 images with patch 14 (16 image tokens); CogAgent adds a 2-layer, width-64
    EVA-CLIP-L style encoder on 112x112 images (64 cross tokens) and cross attention of 4x16."""
    eva = dict(EVA_E_ARGS, num_layers=2, hidden_size=64, num_attention_heads=4, inner_hidden_size=256,
               image_size=[56, 56], max_sequence_length=17)
    common = {
        "tokenizer_type": TINY_TOKENIZER_TYPE, "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "vocab_size": 1024, "layernorm_order": "pre", "model_parallel_size": 1, "max_sequence_length": 512,
        "use_bias": False, "inner_hidden_size": 256, "image_length": 16, "eva_args": eva,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    if kind == "cogvlm":
        return {"model_class": "CogVLMModel", **common}
    if kind == "cogagent":
        encoder = {"layers": 2, "width": 64, "head_width": 32, "embed_dim": 32}
        return {"model_class": "CogAgentModel", "text_processor_version": "chat", **common,
                "is_decoder": [True] * common["num_layers"], "cross_attn_hidden_size": encoder["width"],
                "cross_hidden_size_per_attention_head": 16, "encoder_args": encoder, "cross_image_pix": 112}
    raise ValueError(f"kind must be 'cogvlm' or 'cogagent', not {kind!r}")


def model_class_for(kind_or_name: str, finetune: bool = True):
    from . import models
    name = {"cogvlm": "CogVLMModel", "cogagent": "CogAgentModel"}.get(kind_or_name, kind_or_name)
    if finetune and not name.startswith("FineTuneTrain"):
        name = "FineTuneTrain" + name
    return getattr(models, name)


def _run_defaults() -> dict:
    """Settings of a single-process CPU run that SAT's ``get_model``/``BaseModel`` read."""
    return {
        "mode": "finetune", "fp16": False, "bf16": False, "device": "cpu", "seed": 1234,
        "skip_init": False, "use_gpu_initialization": False, "deepspeed": False,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")), "rank": int(os.environ.get("RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "checkpoint_activations": False,
        "checkpoint_num_layers": 1, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "max_length": TINY_MAX_LENGTH,
    }


def tiny_args(kind: str = "cogvlm", directory: Optional[str] = None, finetune: bool = True,
              **overrides) -> argparse.Namespace:
    """Arguments for ``sat.model.base_model.get_model(args, model_cls)`` building the tiny ``kind``
    ('cogvlm' or 'cogagent'): the model class's SAT defaults, the tiny config, single-process CPU
    run settings (no dropout), then ``overrides``. With ``directory``, also writes
    ``directory/model_config.json``. ``args.model_class`` names the matching FineTuneTrain class."""
    config = tiny_config(kind)
    cls = model_class_for(config["model_class"], finetune=finetune)
    args = cls.get_args()
    for key, value in {**_run_defaults(), **copy.deepcopy(config), **overrides}.items():
        setattr(args, key, value)
    args.model_class = cls.__name__
    if directory is not None:
        write_model_config(args, directory)
    return args


def model_config_dict(args) -> dict:
    """The ``model_config.json`` content for ``args``: upstream's fields, in upstream's order, that
    ``args`` has (architecture optional fields only when not SAT's default)."""
    sat_defaults = {"is_decoder": False, "cross_attn_hidden_size": None, "use_bias": True,
                    "inner_hidden_size": None, "cross_hidden_size_per_attention_head": None}
    out = {}
    for key in CONFIG_FIELDS:
        if not hasattr(args, key):
            continue
        value = getattr(args, key)
        if key in sat_defaults and value == sat_defaults[key]:
            continue
        if key == "encoder_args" and not getattr(args, "is_decoder", False):
            continue
        out[key] = copy.deepcopy(value)
    return out


def write_model_config(args, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "model_config.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(model_config_dict(args), f, indent=4)
    return path


def read_model_config(directory_or_file: str) -> dict:
    path = directory_or_file
    if os.path.isdir(path):
        path = os.path.join(path, "model_config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def save_pretrained_dir(model, args, directory: str, iteration: int = 1) -> str:
    """Write ``model`` in SAT's checkpoint layout so ``Model.from_pretrained(directory, args)`` /
    ``--from_pretrained directory`` load it: model_config.json, ``latest``, and every model-parallel
    rank's ``<iteration>/mp_rank_XX_model_states.pt`` (every rank calls this).

    The ranks write into a temporary sibling directory that global rank 0 then renames to
    ``directory`` (:mod:`sat_patches.checkpoints.writer`): ``directory`` is replaced as a whole, and
    only by a complete checkpoint."""
    import torch.distributed as dist
    from sat import mpu
    from ..checkpoints import writer
    from ..core.coordination import barrier
    first = not dist.is_initialized() or dist.get_rank() == 0
    staged = writer.staging_dir_for(directory, shared=True)
    if first:
        shutil.rmtree(staged, ignore_errors=True)  # left by a save that crashed
        os.makedirs(staged)
    barrier(f"staging '{directory}'")
    module = model.module if hasattr(model, "module") else model
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    mp_rank = mpu.get_model_parallel_rank() if mpu.model_parallel_is_initialized() else 0
    writer.write_layout(staged, iteration, {mp_rank: {"module": state, "iteration": iteration}},
                        config=model_config_dict(args) if mp_rank == 0 else None, latest=mp_rank == 0)
    barrier(f"saved a shard of '{directory}'")
    if first:
        try:
            writer.publish_checkpoint_dir(staged, directory)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    barrier(f"saved '{directory}'")
    return directory
