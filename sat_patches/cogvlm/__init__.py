"""CogVLM and CogAgent for SwissArmyTransformer 0.4.12, plus tiny local stand-ins for their data and tokenizer.

Our own implementation of the architectures in THUDM/CogVLM (``utils/models/*``) with upstream's
parameter names and ``model_config.json`` fields, so released SAT checkpoints (``cogvlm-base-490``,
``cogagent-chat``) load, and small configurations build in milliseconds for tests and CPU runs.
A tiny run's files: ``prepare_tiny_run(folder, kind)``; without files: ``build_tiny_model(kind)``.
"""
import importlib

import sat_patches  # noqa: F401  (makes ``import sat`` work without triton/CUDA)

# name -> the module that defines it, imported on first use (the command-line tools need no torch or SAT).
_MODULES = {
    "captcha_data": ["make_captcha_dataset"],
    "config": ["TINY_MAX_LENGTH", "UPSTREAM_CONFIGS", "model_config_dict", "read_model_config", "tiny_config",
               "write_model_config"],
    "dataset": ["EmptyDatasetError", "ItemDataset", "data_collator"],
    "eva_clip": ["EVA2CLIPModel"],
    "eva_clip_large": ["ExternalVisionModel"],
    "shapes": ["EVA_CLIP_L_DEFAULTS", "upstream_config"],
    "image_mixin": ["GLU", "ImageMixin", "vision_args"],
    "image_processor": ["BlipImageEvalProcessor", "get_image_processor"],
    "jsonl_dataset": ["JsonlDataset", "create_dataset_function"],
    "models": ["CogAgentModel", "CogVLMModel", "FineTuneTrainCogAgentModel", "FineTuneTrainCogVLMModel", "model_class_for"],
    "text_processor": ["TextProcessor", "llama2_text_processor"],
    "tiny": ["TinyRun", "build_tiny_model", "prepare_tiny_run", "tiny_args"],
    "saving": ["save_pretrained_dir"],
    "tokenizer": ["check_vocab", "llama2_tokenizer", "train_tiny_tokenizer"],
    "vision_expert": ["LlamaVisionExpertAttnMixin", "LlamaVisionExpertFCMixin"],
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
