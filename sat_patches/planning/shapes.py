"""The parameters of a CogVLM/CogAgent model's parts, per model-parallel rank, from its ``model_config.json``
(upstream's fields and model code; ``cogvlm-base-224`` with upstream's LoRA counts 17,657,466,368, as SAT prints).
Any LLaMA-shaped ``model_config.json`` is counted the same way.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import List

from ..cogvlm.shapes import EVA_CLIP_L_DEFAULTS, RELEASED, cross_tokens, upstream_config
from ..core.kinds import KINDS


def plan_config(config: dict) -> dict:
    """A CogVLM/CogAgent ``model_config.json`` as the plan reads it: every language layer has vision experts
    (upstream's models add them to all of them), CogAgent's encoder with the code's defaults."""
    config = copy.deepcopy(config)
    if config.get("model_class", "").startswith(("CogVLM", "CogAgent", "FineTuneTrainCog")):
        config.setdefault("num_vision_layers", config["num_layers"])
    if config.get("cross_image_pix"):
        config["encoder_args"] = {**EVA_CLIP_L_DEFAULTS, **(config.get("encoder_args") or {})}
    return config


MODELS = {name: plan_config(upstream_config(name)) for name in RELEASED}
# upstream finetune_demo --max_length (it includes the image tokens)
DEMO_MAX_LENGTH = {490: 1288, 224: 400}


@dataclass
class Part:
    """Parameters of one model component: ``split`` ones are divided over model-parallel ranks."""
    name: str
    split: int = 0
    replicated: int = 0
    buffer: bool = False            # persistent buffers: memory, not parameters

    def per_rank(self, mp: int) -> float:
        return self.split / mp + self.replicated

    @property
    def total(self) -> int:
        return self.split + self.replicated


def _linear(d_in, d_out, bias, kind="column") -> Part:
    """A SAT parallel linear: column-parallel splits weight and bias; row-parallel splits the weight."""
    split = d_in * d_out + (d_out if bias and kind == "column" else 0)
    return Part("", split, d_out if bias and kind == "row" else 0)


def _sum(name, parts, times=1) -> Part:
    return Part(name, times * sum(p.split for p in parts), times * sum(p.replicated for p in parts))


def language_parts(c: dict) -> List[Part]:
    h, f, L, V = c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"], c["num_layers"], c["vocab_size"]
    bias = c.get("use_bias", True)
    layer = [_linear(h, 3 * h, bias), _linear(h, h, bias, "row"), _linear(h, f, bias), _linear(f, h, bias, "row"),
             _linear(h, f, False), Part("", 0, 2 * h)]          # qkv, dense, h->4h, 4h->h, LLaMA gate, 2 RMSNorms
    vocab = Part("", V * h) if V >= 1000 else Part("", 0, V * h)   # SAT: VocabParallelEmbedding from 1000 up
    return [Part("embedding + LM head", vocab.split + V * h, vocab.replicated + h),
            _sum("language layers", layer, L)]


def vision_expert_parts(c: dict) -> List[Part]:
    n = c.get("num_vision_layers", 0)
    if not n:
        return []
    h, f = c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"]
    n = min(n, c["num_layers"])
    attn = [_linear(h, 3 * h, c.get("vision_qkv_bias", False)), _linear(h, h, False, "row")]
    mlp = [_linear(h, f, False), _linear(h, f, False), _linear(f, h, False, "row")]
    return [_sum("vision-expert attention", attn, n), _sum("vision-expert MLP", mlp, n)]


def _eva_layer(e: dict) -> List[Part]:
    h, f = e["hidden_size"], e["inner_hidden_size"]
    return [Part("", 0, 4 * h), _linear(h, 3 * h, True), _linear(h, h, True, "row"),
            _linear(h, f, True), _linear(f, h, True, "row")]


def eva_parts(c: dict) -> List[Part]:
    e = c.get("eva_args")
    if not e:
        return []
    h, h_lm, f_lm = e["hidden_size"], c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"]
    patch_embedding = h * e.get("in_channels", 3) * e["patch_size"] ** 2 + h
    embed = e.get("vocab_size", 1) * h + e["max_sequence_length"] * h + patch_embedding
    tower = _sum("EVA2-CLIP vision tower", _eva_layer(e), e["num_layers"])
    tower.replicated += embed
    glu = h * h_lm + 2 * h_lm + 3 * h_lm * f_lm + 2 * h_lm       # linear_proj, norm1, 3 MLP matrices, boi/eoi
    if c.get("cross_image_pix"):
        glu += c["image_length"] * h                              # CogAgent's ImageMixin.pos_embed
    return [tower, Part("GLU adapter", 0, glu)]


def cross_parts(c: dict) -> List[Part]:
    """CogAgent: cross attention in every language layer and the high-resolution EVA2-CLIP-L encoder."""
    if not c.get("cross_image_pix"):
        return []
    h, L = c["hidden_size"], c["num_layers"]
    inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
    layer = [_linear(h, inner, False), _linear(c["cross_attn_hidden_size"], 2 * inner, False),
             _linear(inner, h, False, "row"), Part("", 0, h)]
    enc = c["encoder_args"]
    w, m, p = enc["width"], int(enc["width"] * enc["mlp_ratio"]), enc["patch_size"]
    n = cross_tokens(c)
    block = 2 * w + 2 * w + 3 * w * w + 2 * w + w * w + w + 2 * w + 2 * (m * w + m) + 2 * m + w * m + w
    encoder = (n * w + w + (n + 1) * w + 3 * w * p * p + w + enc["layers"] * block + 2 * w
               + enc["embed_dim"] * w + enc["embed_dim"])
    rope_buffers = 2 * n * enc["head_width"] * (enc["layers"] + 1)
    return [_sum("cross attention", layer, L), Part("EVA2-CLIP-L encoder", 0, encoder),
            Part("encoder rotary tables", 0, rope_buffers, buffer=True)]


def model_parts(c: dict) -> List[Part]:
    return language_parts(c) + vision_expert_parts(c) + eva_parts(c) + cross_parts(c)


def lora_parts(c: dict, rank: int, eva: bool = True) -> List[Part]:
    """SAT ``LoraMixin`` on every layer's attention (qkv with 3 partitions, dense), on EVA's layers as
    upstream's demo adds, and on CogAgent's cross attention. Column-parallel: B split; row: A split."""
    if not rank:
        return []
    r = rank

    def attention(h):  # qkv: A 3 x (r, h) full, B 3 x (h, r) split; dense (row): A (r, h) split, B (h, r) full
        return Part("", 3 * h * r + r * h, 3 * r * h + h * r)
    parts = [_sum("LoRA (language)", [attention(c["hidden_size"])], c["num_layers"])]
    if eva and c.get("eva_args"):
        e = c["eva_args"]
        parts.append(_sum("LoRA (EVA)", [attention(e["hidden_size"])], e["num_layers"]))
    if c.get("cross_image_pix"):
        h, ch = c["hidden_size"], c["cross_attn_hidden_size"]
        inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
        cross = Part("", inner * r + r * inner + 2 * inner * r, h * r + r * h + 2 * r * ch)
        parts.append(_sum("LoRA (cross attention)", [cross], c["num_layers"]))
    return parts


def demo_trainable_parts(c: dict) -> List[Part]:
    """Beyond LoRA, what upstream's finetune_demo ``disable_untrainable_params`` leaves trainable:
    CogVLM the MLP of EVA layers 46-54; CogAgent the encoder, cross attention, GLU adapter, both
    vision experts, boi/eoi and the whole EVA tower (names matched as upstream does)."""
    e = c.get("eva_args")
    if not e:
        return []
    if not c.get("cross_image_pix"):
        layers = KINDS["cogvlm"].demo_eva_mlp_layers(e["num_layers"])
        h, f = e["hidden_size"], e["inner_hidden_size"]
        return [_sum("EVA MLP, layers 46-54", [_linear(h, f, True), _linear(f, h, True, "row")], layers)]
    named = {p.name: p for p in model_parts(c)}
    return [named[n] for n in ("EVA2-CLIP-L encoder", "cross attention", "GLU adapter", "vision-expert attention",
                               "vision-expert MLP", "EVA2-CLIP vision tower")]


def parameter_count(c: dict, lora_rank: int = 0, lora_eva: bool = True) -> int:
    return int(sum(p.total for p in model_parts(c) + lora_parts(c, lora_rank, lora_eva) if not p.buffer))


def heads(c: dict) -> List[int]:
    """Head counts a model-parallel size must divide."""
    out = [c["num_attention_heads"]]
    if c.get("eva_args"):
        out.append(c["eva_args"]["num_attention_heads"])
    return out


def resolve_model(name: str) -> dict:
    if name in MODELS:
        return copy.deepcopy(MODELS[name])
    path = os.path.join(name, "model_config.json") if os.path.isdir(name) else name
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        return plan_config(config)
    raise SystemExit(f"sat-patches plan: unknown model {name!r}: give one of {', '.join(MODELS)} "
                     f"or a checkpoint directory / model_config.json")


def default_seq_len(config: dict) -> int:
    e = config.get("eva_args")
    if not e:
        return 512
    return DEMO_MAX_LENGTH.get(e.get("image_size", [490])[0], config.get("image_length", 256) + 144)
