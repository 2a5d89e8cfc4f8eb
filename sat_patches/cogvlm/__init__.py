"""CogVLM and CogAgent for SwissArmyTransformer 0.4.12, plus tiny local stand-ins for their data and tokenizer.

Our own implementation of the architectures in THUDM/CogVLM (``utils/models/*``) with upstream's
parameter names and ``model_config.json`` fields, so released SAT checkpoints (``cogvlm-base-490``,
``cogagent-chat``) load, and small configurations build in milliseconds for tests and CPU runs.

Tiny run, as upstream's ``finetune_demo`` does it (``args`` from ``sat.get_args`` plus the demo's
own options, e.g. ``--max_length 80 --local_tokenizer <run.tokenizer_dir>``)::

    import sat_patches
    from sat_patches.cogvlm import (prepare_tiny_run, FineTuneTrainCogVLMModel, llama2_tokenizer,
                                    llama2_text_processor, get_image_processor, ItemDataset, data_collator)
    run = prepare_tiny_run("/tmp/tiny", "cogvlm")          # tokenizer/, data/train, data/valid, model/
    model, args = FineTuneTrainCogVLMModel.from_pretrained(run.model_dir, args)
    tokenizer = llama2_tokenizer(run.tokenizer_dir, signal_type="base")
    text_processor = llama2_text_processor(tokenizer, run.max_length, args.image_length)
    image_processor = get_image_processor(args.eva_args["image_size"][0])
    train = ItemDataset(image_processor, text_processor, args, run.train_dir)   # collate_fn=data_collator

Without files: ``model, args = build_tiny_model("cogagent")`` (SAT ``get_model`` on ``tiny_args``).
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
