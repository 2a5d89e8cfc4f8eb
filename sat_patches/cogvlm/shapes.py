"""Model shapes of CogVLM and CogAgent (the released ``model_config.json`` fields), without torch or SAT: the
one table that the models, the memory plan and the scripts' checks read."""
from __future__ import annotations

import copy
from typing import Dict

EVA_CLIP_L_DEFAULTS = {
    "layers": 24, "width": 1024, "head_width": 64, "mlp_ratio": 2.6667, "patch_size": 14,
    "embed_dim": 768, "pt_hw_seq_len": 16, "layernorm_epsilon": 1e-6,
}

EVA_E_ARGS = {  # EVA2-CLIP-E as released with CogVLM/CogAgent (eva_args of model_config.json)
    "model_class": "EVA2CLIPModel", "num_layers": 63, "hidden_size": 1792, "num_attention_heads": 16,
    "vocab_size": 1, "layernorm_order": "post", "model_parallel_size": 1, "max_sequence_length": 257,
    "inner_hidden_size": 15360, "use_final_layernorm": False, "layernorm_epsilon": 1e-06,
    "row_parallel_linear_final_bias": False, "image_size": [224, 224], "pre_len": 1, "post_len": 0,
    "in_channels": 3, "patch_size": 14,
}

LLAMA_7B = {
    "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 32000,
    "layernorm_order": "pre", "model_parallel_size": 1, "max_sequence_length": 4096,
}

UPSTREAM_CONFIGS = {
    "cogvlm-base-490": {
        "model_class": "CogVLMModel", "tokenizer_type": "vicuna-7b-v1.5", **LLAMA_7B,
        "use_bias": False, "inner_hidden_size": 11008, "image_length": 1225,
        "eva_args": dict(EVA_E_ARGS, max_sequence_length=1226, image_size=[490, 490]),
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    "cogagent-chat": {
        "model_class": "CogAgentModel", "tokenizer_type": "vicuna-7b-v1.5", "text_processor_version": "chat",
        **LLAMA_7B, "is_decoder": [True] * 32, "cross_attn_hidden_size": 1024, "use_bias": False,
        "inner_hidden_size": 11008, "cross_hidden_size_per_attention_head": 32, "encoder_args": {},
        "image_length": 256, "cross_image_pix": 1120, "eva_args": dict(EVA_E_ARGS),
        "use_neft_noise": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
}


# released names: which entry of the table each one has the shape of
RELEASED: Dict[str, str] = {
    "cogvlm-base-224": "cogvlm-base-224", "cogvlm-base-490": "cogvlm-base-490", "cogvlm-chat-v1.1": "cogvlm-base-490",
    "cogvlm-grounding-base": "cogvlm-base-490", "cogvlm-grounding-generalist": "cogvlm-base-490",
    "cogagent-chat": "cogagent-chat", "cogagent-vqa": "cogagent-chat",
}


def upstream_config(name: str) -> dict:
    """The ``model_config.json`` of released model ``name`` (a copy), CogAgent's encoder defaults filled in."""
    shape = RELEASED[name]
    config = copy.deepcopy(UPSTREAM_CONFIGS["cogvlm-base-490" if shape == "cogvlm-base-224" else shape])
    if shape == "cogvlm-base-224":
        config.update(image_length=256, eva_args=dict(EVA_E_ARGS, max_sequence_length=257, image_size=[224, 224]))
    if "cross_image_pix" in config:
        config["encoder_args"] = {**EVA_CLIP_L_DEFAULTS, **config.get("encoder_args", {})}
    return config


def cross_tokens(c: dict) -> int:
    """Image tokens of CogAgent's high-resolution encoder (``c["encoder_args"]`` filled in)."""
    return (c["cross_image_pix"] // c["encoder_args"]["patch_size"]) ** 2
