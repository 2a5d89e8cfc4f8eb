"""``model_config.json``: the tiny stand-in's, and writing one for ``args`` with the released checkpoints'
field names in their order."""
from __future__ import annotations

import copy
import json
import os

from ..checkpoints.model_config import read_model_config  # noqa: F401  (the one reader, checking)
from ..core import kinds
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
# the tiny language model and image tower (16 image tokens: 56x56 px images in patches of 14)
TINY_LANGUAGE = {"tokenizer_type": TINY_TOKENIZER_TYPE, "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                 "vocab_size": 1024, "max_sequence_length": 512, "inner_hidden_size": 256, "image_length": 16}
TINY_EVA = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "inner_hidden_size": 256,
            "image_size": [56, 56], "max_sequence_length": 17}
# upstream's ImageMixin hard-codes the projector's input width whatever model_config.json says
UPSTREAM_EVA_WIDTH = 1792


def tiny_config(kind: str = "cogvlm", upstream_classes: bool = False) -> dict:
    """The tiny stand-in's ``model_config.json`` content (sizes: :data:`TINY_LANGUAGE`, :data:`TINY_EVA`; CogAgent
    adds a 2-layer, width-64 encoder on 112 px images). ``upstream_classes``: for upstream's own classes, the
    released config with the tiny values where those classes read them (EVA as wide as their projector takes)."""
    if upstream_classes:
        config = copy.deepcopy(UPSTREAM_CONFIGS[kinds.kind(kind).released])
        config.update({k: v for k, v in TINY_LANGUAGE.items() if k in config})
        config["eva_args"].update(TINY_EVA, hidden_size=UPSTREAM_EVA_WIDTH, num_attention_heads=16,
                                  inner_hidden_size=512, num_layers=1)
        if kind == "cogagent":
            config.update(is_decoder=[True] * config["num_layers"], cross_image_pix=112, encoder_args={"layers": 1})
        return config
    common = {**TINY_LANGUAGE, "layernorm_order": "pre", "model_parallel_size": 1, "use_bias": False,
              "eva_args": dict(EVA_E_ARGS, **TINY_EVA), "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = {"model_class": kinds.kind(kind).model_class}
    if kind == "cogvlm":
        return {**model, **common}
    encoder = {"layers": 2, "width": 64, "head_width": 32, "embed_dim": 32}
    return {**model, "text_processor_version": "chat", **common,
            "is_decoder": [True] * common["num_layers"], "cross_attn_hidden_size": encoder["width"],
            "cross_hidden_size_per_attention_head": 16, "encoder_args": encoder, "cross_image_pix": 112}


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
