"""SAT <-> Hugging Face names of CogVLM and CogAgent (the layout of ``THUDM/cogvlm-chat-hf`` /
``cogagent-chat-hf``), and their ``config.json``. Every tensor keeps its shape and values; only the rotary
``inv_freq`` buffer is not one-to-one (SAT keeps one for the model, HF one per layer). Needs neither torch nor SAT.
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, List, Tuple

from ..cogvlm.shapes import EVA_CLIP_L_DEFAULTS, EVA_E_ARGS

SAT_DEFAULT_EPS = 1e-5   # SAT's --layernorm-epsilon default, what a model_config.json without one was built with
MODELS = {"CogVLMModel": "CogVLMForCausalLM", "CogAgentModel": "CogAgentForCausalLM"}
# the released config.json's auto_map: its remote code as files of the folder itself
AUTO_MAP = {
    "CogVLMModel": {"AutoConfig": "configuration_cogvlm.CogVLMConfig",
                    "AutoModelForCausalLM": "modeling_cogvlm.CogVLMForCausalLM"},
    "CogAgentModel": {"AutoConfig": "configuration_cogagent.CogAgentConfig",
                      "AutoModelForCausalLM": "modeling_cogagent.CogAgentForCausalLM"},
}
# the hub repositories that code is released in
HUB_REPOS = {"CogVLMModel": "THUDM/cogvlm-chat-hf", "CogAgentModel": "THUDM/cogagent-chat-hf"}
INV_FREQ = "mixins.rotary.rotary_emb.inv_freq"
HF_INV_FREQ = "model.layers.{}.self_attn.rotary_emb.inv_freq"


class UnknownKeyError(ValueError):
    """A checkpoint key with no place in the Hugging Face layout (or the reverse)."""


# (SAT pattern, HF pattern): ``{N}`` is a layer index, ``{X}`` any rest of a name (copied as it is)
_RULES: List[Tuple[str, str]] = [
    ("transformer.word_embeddings.weight", "model.embed_tokens.weight"),
    ("transformer.final_layernorm.weight", "model.norm.weight"),
    ("mixins.lm.lm_head.weight", "lm_head.weight"),
    ("transformer.layers.{N}.input_layernorm.weight", "model.layers.{N}.input_layernorm.weight"),
    ("transformer.layers.{N}.post_attention_layernorm.weight", "model.layers.{N}.post_attention_layernorm.weight"),
    ("transformer.layers.{N}.attention.query_key_value.weight",
     "model.layers.{N}.self_attn.language_expert_query_key_value.weight"),
    ("transformer.layers.{N}.attention.dense.weight", "model.layers.{N}.self_attn.language_expert_dense.weight"),
    ("mixins.rotary.vision_query_key_value_list.{N}.weight",
     "model.layers.{N}.self_attn.vision_expert_query_key_value.weight"),
    ("mixins.rotary.vision_dense_list.{N}.weight", "model.layers.{N}.self_attn.vision_expert_dense.weight"),
    ("mixins.mlp.gate_proj.{N}.weight", "model.layers.{N}.mlp.language_mlp.gate_proj.weight"),
    ("transformer.layers.{N}.mlp.dense_h_to_4h.weight", "model.layers.{N}.mlp.language_mlp.up_proj.weight"),
    ("transformer.layers.{N}.mlp.dense_4h_to_h.weight", "model.layers.{N}.mlp.language_mlp.down_proj.weight"),
    ("mixins.mlp.vision_gate_proj.{N}.weight", "model.layers.{N}.mlp.vision_mlp.gate_proj.weight"),
    ("mixins.mlp.vision_dense_h_to_4h_list.{N}.weight", "model.layers.{N}.mlp.vision_mlp.up_proj.weight"),
    ("mixins.mlp.vision_dense_4h_to_h_list.{N}.weight", "model.layers.{N}.mlp.vision_mlp.down_proj.weight"),
    # CogAgent: cross attention to the high-resolution encoder
    ("transformer.layers.{N}.cross_attention.{X}", "model.layers.{N}.cross_attn.{X}"),
    ("transformer.layers.{N}.post_cross_attention_layernorm.weight",
     "model.layers.{N}.post_cross_attention_layernorm.weight"),
    # EVA2-CLIP and its GLU projector
    ("mixins.eva.boi", "model.vision.boi"),
    ("mixins.eva.eoi", "model.vision.eoi"),
    ("mixins.eva.pos_embed", "model.vision.pos_embed"),
    ("mixins.eva.linear_proj.{X}", "model.vision.linear_proj.{X}"),
    ("mixins.eva.vit_model.mixins.patch_embedding.proj.{X}", "model.vision.patch_embedding.proj.{X}"),
    ("mixins.eva.vit_model.transformer.word_embeddings.weight", "model.vision.patch_embedding.cls_embedding"),
    ("mixins.eva.vit_model.transformer.position_embeddings.weight",
     "model.vision.patch_embedding.position_embedding.weight"),
    ("mixins.eva.vit_model.transformer.layers.{N}.mlp.dense_h_to_4h.{X}",
     "model.vision.transformer.layers.{N}.mlp.fc1.{X}"),
    ("mixins.eva.vit_model.transformer.layers.{N}.mlp.dense_4h_to_h.{X}",
     "model.vision.transformer.layers.{N}.mlp.fc2.{X}"),
    ("mixins.eva.vit_model.transformer.layers.{N}.{X}", "model.vision.transformer.layers.{N}.{X}"),
    # CogAgent: the high-resolution cross encoder (EVA2-CLIP-L), its names unchanged under cross_vision
    ("mixins.encoder.pos_embed", "model.cross_vision.pos_embed"),
    ("mixins.encoder.vit.model.{X}", "model.cross_vision.vit.model.{X}"),
]


def _regex(pattern: str) -> "re.Pattern":
    out = re.escape(pattern).replace(r"\{N\}", r"(?P<N>\d+)").replace(r"\{X\}", r"(?P<X>[A-Za-z0-9_.]+)")
    return re.compile(out + "$")


_COMPILED = [(_regex(s), s, _regex(h), h) for s, h in _RULES]


def _fill(pattern: str, match: "re.Match") -> str:
    groups = match.groupdict()
    return pattern.replace("{N}", groups.get("N") or "").replace("{X}", groups.get("X") or "")


def hf_name(sat_key: str) -> str:
    """The HF name of a SAT state-dict key (not :data:`INV_FREQ`, which has one per layer)."""
    for sat_re, _, _, hf in _COMPILED:
        m = sat_re.match(sat_key)
        if m:
            return _fill(hf, m)
    raise UnknownKeyError(f"'{sat_key}' has no place in the Hugging Face layout of CogVLM/CogAgent")


_HF_INV_FREQ = re.compile(r"model\.layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq$")


def sat_name(hf_key: str) -> str:
    """The SAT state-dict key of an HF name (every layer's ``inv_freq`` is :data:`INV_FREQ`)."""
    if _HF_INV_FREQ.match(hf_key):
        return INV_FREQ
    for _, sat, hf_re, _ in _COMPILED:
        m = hf_re.match(hf_key)
        if m:
            return _fill(sat, m)
    raise UnknownKeyError(f"'{hf_key}' is not a tensor of CogVLM/CogAgent in the Hugging Face layout")


def hf_names(sat_key: str, num_layers: int) -> List[str]:
    """Every HF name ``sat_key`` is written under (one, or one per layer for :data:`INV_FREQ`)."""
    if sat_key == INV_FREQ:
        return [HF_INV_FREQ.format(i) for i in range(num_layers)]
    return [hf_name(sat_key)]


def auto_map(model_class: str, local_code: bool) -> dict:
    """``config.json``'s ``auto_map``: with ``local_code`` the released one (the code's files sit in the folder);
    without, in transformers' hub-reference form (``THUDM/cogvlm-chat-hf--modeling_cogvlm.CogVLMForCausalLM``)."""
    if local_code:
        return dict(AUTO_MAP[model_class])
    return {auto: f"{HUB_REPOS[model_class]}--{ref}" for auto, ref in AUTO_MAP[model_class].items()}


def hf_config(config: dict, torch_dtype: str, local_code: bool = False) -> dict:
    """``config.json`` of the HF folder for a SAT ``model_config.json`` ``config`` (CogVLM or CogAgent); its
    ``auto_map`` names the code in the folder with ``local_code``, else the released repository's (:func:`auto_map`)."""
    cls = config["model_class"]
    if cls not in MODELS:
        raise ValueError(f"model_class {cls!r} is not CogVLM or CogAgent ({', '.join(MODELS)})")
    eva = config["eva_args"]
    image = eva["image_size"][0] if isinstance(eva.get("image_size"), list) else eva.get("image_size", 224)
    out = {
        "architectures": [MODELS[cls]],
        "auto_map": auto_map(cls, local_code),
        "bos_token_id": config.get("bos_token_id", 1), "eos_token_id": config.get("eos_token_id", 2),
        "pad_token_id": config.get("pad_token_id", 0),
        "hidden_act": "silu", "hidden_size": config["hidden_size"], "initializer_range": 0.02,
        "intermediate_size": config["inner_hidden_size"], "max_position_embeddings": config["max_sequence_length"],
        "num_attention_heads": config["num_attention_heads"], "num_hidden_layers": config["num_layers"],
        "rms_norm_eps": config.get("layernorm_epsilon", SAT_DEFAULT_EPS),
        "template_version": "chat" if config.get("text_processor_version") == "chat" else "base",
        "tie_word_embeddings": False, "torch_dtype": torch_dtype,
        "use_cache": True, "vocab_size": config["vocab_size"],
        "vision_config": {
            "dropout_prob": 0.0, "hidden_act": "gelu", "in_channels": eva.get("in_channels", 3),
            "num_hidden_layers": eva["num_layers"], "hidden_size": eva["hidden_size"],
            "patch_size": eva.get("patch_size", 14), "num_heads": eva["num_attention_heads"],
            "intermediate_size": eva["inner_hidden_size"], "layer_norm_eps": eva.get("layernorm_epsilon", 1e-6),
            "num_positions": eva["max_sequence_length"], "image_size": image,
        },
    }
    if cls == "CogAgentModel":
        encoder = {**EVA_CLIP_L_DEFAULTS, **(config.get("encoder_args") or {})}
        out.update(cross_hidden_size=config["cross_attn_hidden_size"],
                   cross_compute_hidden_size=config["num_attention_heads"] * config["cross_hidden_size_per_attention_head"],
                   cross_image_size=config["cross_image_pix"], cross_vision_config=encoder)
    return out


def sat_config(hf: dict, mp: int) -> dict:
    """``model_config.json`` of a SAT checkpoint at model-parallel size ``mp`` for an HF ``config.json``."""
    archs = hf.get("architectures") or []
    cls = next((sat for sat, name in MODELS.items() if name in archs), None)
    if cls is None:
        raise ValueError(f"config.json names architectures {archs}: not CogVLM or CogAgent "
                         f"({', '.join(MODELS.values())})")
    vision = hf["vision_config"]
    image = vision["image_size"]
    patch = vision.get("patch_size", 14)
    eva = dict(EVA_E_ARGS, num_layers=vision["num_hidden_layers"], hidden_size=vision["hidden_size"],
               num_attention_heads=vision["num_heads"], inner_hidden_size=vision["intermediate_size"],
               layernorm_epsilon=vision.get("layer_norm_eps", 1e-6), max_sequence_length=vision["num_positions"],
               image_size=[image, image], in_channels=vision.get("in_channels", 3), patch_size=patch)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    out: Dict = {"model_class": cls, "tokenizer_type": "vicuna-7b-v1.5"}
    if hf.get("template_version", "base") != "base":
        out["text_processor_version"] = "chat"
    out.update(num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
               vocab_size=hf["vocab_size"], layernorm_order="pre", model_parallel_size=mp,
               max_sequence_length=hf.get("max_position_embeddings", 2048))
    out.update(use_bias=False, inner_hidden_size=hf["intermediate_size"], image_length=(image // patch) ** 2)
    if cls == "CogAgentModel":
        encoder = hf.get("cross_vision_config") or {}
        out.update(is_decoder=[True] * layers, cross_attn_hidden_size=hf["cross_hidden_size"],
                   cross_hidden_size_per_attention_head=hf["cross_compute_hidden_size"] // heads,
                   encoder_args={k: v for k, v in encoder.items() if EVA_CLIP_L_DEFAULTS.get(k) != v},
                   cross_image_pix=hf["cross_image_size"])
    out["eva_args"] = eva
    out.update(bos_token_id=hf.get("bos_token_id", 1), eos_token_id=hf.get("eos_token_id", 2),
               pad_token_id=hf.get("pad_token_id", 0), layernorm_epsilon=hf.get("rms_norm_eps", 1e-6))
    return out


def generation_config(hf: dict) -> dict:
    return {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"],
            "pad_token_id": hf["pad_token_id"]}


def hf_items(sat_keys, num_layers: int) -> Iterator[Tuple[str, str]]:
    """``(hf name, sat key)`` for every SAT key, in the order of the SAT keys."""
    for key in sat_keys:
        for name in hf_names(key, num_layers):
            yield name, key
