"""The language model of an exported CogVLM / CogAgent folder as transformers' ``LlamaForCausalLM`` (state dict
and config): for text-only input CogVLM's language path is LLaMA's.
"""
from __future__ import annotations

from typing import Dict

import torch


def llama_state_dict(hf: Dict[str, torch.Tensor], hidden_size: int) -> Dict[str, torch.Tensor]:
    """``LlamaForCausalLM``'s state dict from the tensors of an exported folder (``model.*`` names): the fused
    ``language_expert_query_key_value`` is [q|k|v] in thirds of ``hidden_size`` rows (heads contiguous in each),
    every other language weight maps one to one. Vision experts, EVA and the cross-attention of CogAgent are
    left out."""
    out = {"model.embed_tokens.weight": hf["model.embed_tokens.weight"], "model.norm.weight": hf["model.norm.weight"],
           "lm_head.weight": hf["lm_head.weight"]}
    layers = sorted({int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")})
    for i in layers:
        p = f"model.layers.{i}."
        q, k, v = hf[p + "self_attn.language_expert_query_key_value.weight"].split(hidden_size, dim=0)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": hf[p + "self_attn.language_expert_dense.weight"],
                    p + "input_layernorm.weight": hf[p + "input_layernorm.weight"],
                    p + "post_attention_layernorm.weight": hf[p + "post_attention_layernorm.weight"]})
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{proj}.weight"] = hf[p + f"mlp.language_mlp.{proj}.weight"]
    return out


def llama_config_kwargs(config: dict) -> dict:
    """``transformers.LlamaConfig`` keyword arguments from an exported ``config.json`` (multi-head attention, no
    biases, untied output layer, as CogVLM's language model)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "rms_norm_eps", "max_position_embeddings", "hidden_act")
    return dict({k: config[k] for k in keys}, num_key_value_heads=config["num_attention_heads"],
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
