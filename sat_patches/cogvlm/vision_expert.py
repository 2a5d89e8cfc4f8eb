"""Vision-expert MLP and attention mixins of CogVLM's language model (upstream ``utils/models/mixin.py``).

In every layer of ``vision_layer_range`` the tokens marked by ``vision_expert_mask`` go through their own
projections, the others through the LLaMA layer's (read at call time, so SAT's ``LoraMixin`` applies).
Parameter names are upstream's. Tokens are routed without boolean-mask gathers (:mod:`.routing`);
:func:`expert_mlp_forward` and :func:`expert_attention_forward` read only upstream's attribute names, so a
fork's own mixin classes take them too (``sat_patches.patches.fork_models``).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from sat.model.base_model import BaseMixin
from sat.model.position_embedding.triton_rotary_embeddings import FastRotaryEmbedding
from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear
from sat.mpu.utils import split_tensor_along_last_dim
from sat.transformer_defaults import attention_fn_default

from ..kernels.compiled import layer_body
from ..runtime.tensor_memo import TensorMemo
from .placement import Placement
from .routing import ExpertRouting, expert_routing


def vision_layers(num_layers: int, num_vision_layers: int, vision_layer_range: Optional[Sequence[int]]):
    if vision_layer_range is None:
        return list(range(min(num_vision_layers, num_layers)))
    return [int(i) for i in vision_layer_range]


def routing_for(layer_id: int, layer_range, kw_args) -> Optional[ExpertRouting]:
    """How this layer routes tokens to its experts; None when every token takes the language path."""
    mask = kw_args.get("vision_expert_mask")
    if layer_id not in layer_range or mask is None:
        return None
    return expert_routing(mask)


def route(x: torch.Tensor, routing: Optional[ExpertRouting], language: Callable, vision: Callable) -> torch.Tensor:
    return language(x) if routing is None else routing.apply(x, language, vision)


max_position = TensorMemo(lambda position_ids: int(position_ids.max()))
"""The largest position of a batch, read once per step (the rotary cache's length)."""


def _expert_dict(layer_range, build) -> nn.ModuleDict:
    return nn.ModuleDict([(str(i), build()) for i in layer_range])


class LlamaVisionExpertFCMixin(BaseMixin):
    """Gated MLP with a vision expert: ``gate_proj.<i>`` (language gate of every layer, LLaMA's
    ``dense_h_to_4h_gate``) and ``vision_{dense_h_to_4h_list,dense_4h_to_h_list,gate_proj}.<i>``."""

    def __init__(self, in_features, hidden_features, num_layers=32, num_vision_layers=0,
                 vision_layer_range=None, params_dtype=None, device=None, skip_init=True,
                 init_method=None, output_layer_init_method=None):
        super().__init__()
        place = Placement.resolve(params_dtype, device, skip_init, init_method, output_layer_init_method)
        self.vision_layer_range = vision_layers(num_layers, num_vision_layers, vision_layer_range)

        def column(name):
            return ColumnParallelLinear(in_features, hidden_features, gather_output=False, bias=False,
                                        module=self, name=name, **place.parallel_kwargs())

        def row(name):
            return RowParallelLinear(hidden_features, in_features, input_is_parallel=True, bias=False,
                                     module=self, name=name, **place.parallel_kwargs(output_layer=True))

        self.gate_proj = nn.ModuleList([column("dense_h_to_4h_gate") for _ in range(num_layers)])
        self.vision_dense_h_to_4h_list = _expert_dict(self.vision_layer_range, lambda: column("vision_dense_h_to_4h"))
        self.vision_dense_4h_to_h_list = _expert_dict(self.vision_layer_range, lambda: row("vision_dense_4h_to_h"))
        self.vision_gate_proj = _expert_dict(self.vision_layer_range, lambda: column("vision_gate_proj"))

    def mlp_forward(self, hidden_states, **kw_args):
        return expert_mlp_forward(self, hidden_states, **kw_args)

    def copy_param(self):
        """Initialise each expert from its layer's language weights (upstream ``copy_param``)."""
        with torch.no_grad():
            for i in self.vision_layer_range:
                mlp = self.transformer.layers[i].mlp
                self.vision_gate_proj[str(i)].weight.copy_(self.gate_proj[i].weight)
                self.vision_dense_h_to_4h_list[str(i)].weight.copy_(mlp.dense_h_to_4h.weight)
                self.vision_dense_4h_to_h_list[str(i)].weight.copy_(mlp.dense_4h_to_h.weight)


class LlamaVisionExpertAttnMixin(BaseMixin):
    """Rotary self-attention with a vision expert: ``vision_query_key_value_list.<i>`` and
    ``vision_dense_list.<i>``; ``rotary_emb`` is SAT's ``FastRotaryEmbedding`` (its ``inv_freq``
    buffer is part of the state dict)."""

    def __init__(self, hidden_size, num_heads, num_layers=28, num_vision_layers=0, use_vision_expert=True,
                 vision_layer_range=None, params_dtype=None, device=None, skip_init=True,
                 init_method=None, output_layer_init_method=None):
        super().__init__()
        place = Placement.resolve(params_dtype, device, skip_init, init_method, output_layer_init_method)
        # upstream: pos_idx_in_fp32=False. inv_freq is computed on the CPU, then placed (on meta its arithmetic
        # would import torch._dynamo)
        self.rotary_emb = FastRotaryEmbedding(hidden_size // num_heads, pos_idx_in_fp32=False,
                                              device="cpu").to(place.device)
        self.vision_layer_range = vision_layers(num_layers, num_vision_layers, vision_layer_range)
        self.use_vision_expert = use_vision_expert
        if use_vision_expert:
            self.vision_query_key_value_list = _expert_dict(self.vision_layer_range, lambda: ColumnParallelLinear(
                hidden_size, 3 * hidden_size, stride=3, gather_output=False, bias=False,
                module=self, name="vision_query_key_value", **place.parallel_kwargs()))
            self.vision_dense_list = _expert_dict(self.vision_layer_range, lambda: RowParallelLinear(
                hidden_size, hidden_size, input_is_parallel=True, bias=False, final_bias=False,
                module=self, name="vision_dense", **place.parallel_kwargs(output_layer=True)))

    def attention_forward(self, hidden_states, mask, **kw_args):
        return expert_attention_forward(self, hidden_states, mask, **kw_args)

    def copy_param(self):
        """Initialise each expert from its layer's language weights (upstream ``copy_param``)."""
        with torch.no_grad():
            for i in self.vision_layer_range:
                attention = self.transformer.layers[i].attention
                self.vision_query_key_value_list[str(i)].weight.copy_(attention.query_key_value.weight)
                self.vision_dense_list[str(i)].weight.copy_(attention.dense.weight)


def gated_mlp(act, language, vision, routing: Optional[ExpertRouting], hidden_states):
    """Upstream's gated MLP, each token through its expert; ``language`` and ``vision`` are (gate, up, down)."""
    def expert(gate, up, down):
        return lambda x: down(act(gate(x)) * up(x))

    return route(hidden_states, routing, expert(*language), vision and expert(*vision)).contiguous()


def expert_mlp_forward(mixin, hidden_states, **kw_args):
    """The gated MLP of layer ``layer_id``, vision tokens through the layer's vision expert. ``mixin`` has
    upstream's attributes (``gate_proj``, ``vision_*_list``, ``vision_layer_range``): this serves CogVLM's
    own mixin class too. The layer's modules are looked up here; :func:`gated_mlp` is the (compilable) body."""
    layer_id = int(kw_args["layer_id"])
    mlp = mixin.transformer.layers[layer_id].mlp
    routing = routing_for(layer_id, mixin.vision_layer_range, kw_args)
    key = str(layer_id)
    vision = routing and (mixin.vision_gate_proj[key], mixin.vision_dense_h_to_4h_list[key],
                          mixin.vision_dense_4h_to_h_list[key])
    language = (mixin.gate_proj[layer_id], mlp.dense_h_to_4h, mlp.dense_4h_to_h)
    return layer_body(gated_mlp)(mlp.activation_func, language, vision, routing, hidden_states)


def expert_attention_forward(mixin, hidden_states, mask, **kw_args):
    """Rotary self-attention of layer ``layer_id``, vision tokens through the vision expert's QKV and dense
    (upstream's attributes, as :func:`expert_mlp_forward`). The rotary cache's length is read once per step."""
    layer_id = int(kw_args["layer_id"])
    attention = mixin.transformer.layers[layer_id].attention
    attention_fn = attention.hooks.get("attention_fn", attention_fn_default)
    key = str(layer_id)
    routing = routing_for(layer_id, mixin.vision_layer_range, kw_args) if mixin.use_vision_expert else None

    project = layer_body(route)  # the routed projections, as the MLP (modules passed in: one graph per kind)
    mixed = project(hidden_states, routing, attention.query_key_value,
                    routing and mixin.vision_query_key_value_list[key])
    query, key_layer, value = (attention._transpose_for_scores(t)
                               for t in split_tensor_along_last_dim(mixed, 3))
    position_ids = kw_args["position_ids"]
    query, key_layer = mixin.rotary_emb(query, key_layer, position_ids, max_seqlen=max_position(position_ids) + 1,
                                        layer_id=kw_args["layer_id"])
    dropout_fn = attention.attention_dropout if attention.training else None
    context = attention_fn(query, key_layer, value, mask, dropout_fn, **kw_args)
    context = context.permute(0, 2, 1, 3).contiguous()
    context = context.view(*context.shape[:-2], attention.hidden_size_per_partition)

    output = project(context, routing, attention.dense, routing and mixin.vision_dense_list[key])
    if attention.training:
        output = attention.output_dropout(output)
    return output.contiguous()
