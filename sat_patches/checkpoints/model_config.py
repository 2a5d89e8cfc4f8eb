"""``model_config.json``: read and checked for the fields SAT builds a model from and sizes a real model can have,
before anything is built (torch-free: the scripts' checks read it before launching)."""
from __future__ import annotations

import json
import os


class CheckpointError(ValueError):
    """A checkpoint directory or ``model_config.json`` that cannot be loaded; says what to change."""


REQUIRED_CONFIG = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def read_json_object(path: str, missing: str, fix: str, error=CheckpointError) -> dict:
    """The JSON object that ``path`` holds, else ``error`` naming the file and what to do: ``missing`` when there
    is no such file, ``fix`` when it is not JSON or not an object."""
    if not os.path.isfile(path):
        raise error(f"'{path}' not found: {missing}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:
        raise error(f"'{path}' is not valid JSON ({exc}): {fix}") from exc
    if not isinstance(data, dict):
        raise error(f"'{path}' must be a JSON object, not {type(data).__name__}: {fix}")
    return data


def read_model_config(model_path: str, need_class: bool = False) -> dict:
    """``model_config.json`` of a checkpoint, checked for the fields SAT builds a model from."""
    path = os.path.join(model_path, "model_config.json")
    config = read_json_object(path, "from_pretrained builds the model from it (SAT's save_checkpoint writes it next "
                                    "to 'latest'); copy it from the model's source",
                              "fix or re-create it from the model's source (a JSON object of its settings)")
    need = REQUIRED_CONFIG + (("model_class",) if need_class else ())
    missing = [k for k in need if k not in config]
    if missing:
        example = '"hidden_size": 4096' + (', "model_class": "CogVLMModel"' if "model_class" in missing else "")
        raise CheckpointError(f"'{path}' lacks {', '.join(missing)}: add them with the values the checkpoint "
                              f"was trained with (e.g. {example})")
    check_model_config(config, path)
    return config


# field -> largest value a real model may have (CogVLM/CogAgent: 32 layers, hidden 4096, 32 heads,
# vocabulary 32000; EVA2-CLIP-E 63 layers at 1792) with room for far larger models
SIZE_LIMITS = {"num_layers": 4096, "hidden_size": 1 << 17, "num_attention_heads": 4096, "vocab_size": 1 << 24,
               "inner_hidden_size": 1 << 20, "max_sequence_length": 1 << 22, "model_parallel_size": 4096,
               "hidden_size_per_attention_head": 1 << 14, "num_multi_query_heads": 4096}


def check_model_config(config, path: str, where: str = "") -> None:
    """Check the sizes a model is built from, before anything is allocated: whole numbers from 1 to
    :data:`SIZE_LIMITS` (optional ones may be null), heads dividing the hidden size, ``eva_args`` the same way."""
    for key, limit in SIZE_LIMITS.items():
        value = config.get(key)
        if value is None and key not in REQUIRED_CONFIG:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise CheckpointError(f"'{path}'{where}: {key} is {value!r}; it must be a whole number from 1 to "
                                  f"{limit}: set the value the checkpoint was trained with")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if config.get("hidden_size_per_attention_head") is None and hidden % heads:
        raise CheckpointError(f"'{path}'{where}: num_attention_heads {heads} does not divide hidden_size {hidden}: "
                              f"set the values the checkpoint was trained with (or hidden_size_per_attention_head)")
    if "eva_args" in config:
        eva = config["eva_args"]
        if not isinstance(eva, dict):
            raise CheckpointError(f"'{path}'{where}: eva_args is {type(eva).__name__}, not a mapping of the vision "
                                  f"tower's settings: copy eva_args from the model's source")
        missing = [k for k in REQUIRED_CONFIG if k not in eva]
        if missing:
            raise CheckpointError(f"'{path}' eva_args lacks {', '.join(missing)}: copy eva_args from the model's "
                                  f"source")
        check_model_config(eva, path, where=" eva_args")
