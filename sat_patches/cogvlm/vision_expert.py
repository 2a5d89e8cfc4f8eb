"""Vision-expert MLP and attention mixins of CogVLM's language model.

Mirrors CogVLM ``utils/models/mixin.py`` (``LlamaVisionExpertFCMixin``,
``LlamaVisionExpertAttnMixin``): in every layer of ``vision_layer_range`` the tokens marked by
``vision_expert_mask`` go through their own QKV/dense and gate/up/down projections, the others
through the LLaMA layer's. Parameter names are upstream's (state_dict keys under
``mixins.mlp.`` / ``mixins.rotary.``), so SAT checkpoints of cogvlm-*/cogagent-* load.

Differences from upstream, none of which changes a parameter name or shape:
* ``params_dtype``/``device``/``skip_init`` are honoured (upstream: fp32 on CPU, always skip_init);
  with ``skip_init=False`` the experts get the transformer's init methods instead of staying
  uninitialised memory.
* The language weights are read from the layer at call time, so SAT's ``LoraMixin`` (which
  replaces ``attention.query_key_value`` etc.) applies to the language path as upstream.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from sat import mpu
from sat.model.base_model import BaseMixin
from sat.model.position_embedding.triton_rotary_embeddings import FastRotaryEmbedding
from sat.mpu.layers import ColumnParallelLinear, RowParallelLinear
from sat.mpu.utils import divide, split_tensor_along_last_dim
from sat.transformer_defaults import attention_fn_default

from .placement import Placement


def vision_layers(num_layers: int, num_vision_layers: int, vision_layer_range: Optional[Sequence[int]]):
    if vision_layer_range is None:
        return list(range(min(num_vision_layers, num_layers)))
    return [int(i) for i in vision_layer_range]


def expert_mask_for(layer_id: int, layer_range, kw_args) -> Optional[torch.Tensor]:
    """The boolean vision-token mask when this layer routes tokens to experts, else None."""
    mask = kw_args.get("vision_expert_mask")
    if layer_id not in layer_range or mask is None:
        return None
    mask = mask.bool()
    return mask if bool(mask.any()) else None


def route(x: torch.Tensor, mask: Optional[torch.Tensor], language: Callable, vision: Callable) -> torch.Tensor:
    """Apply ``language`` to the tokens outside ``mask`` and ``vision`` to those inside."""
    if mask is None:
        return language(x)
    lang_out = language(x[~mask])
    vis_out = vision(x[mask])
    out = lang_out.new_empty(*x.shape[:-1], lang_out.shape[-1])
    out[~mask] = lang_out
    out[mask] = vis_out.to(lang_out.dtype)
    return out


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
        self.num_layers = num_layers
        self.num_vision_layers = num_vision_layers
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
        layer_id = int(kw_args["layer_id"])
        mlp = self.transformer.layers[layer_id].mlp
        act = mlp.activation_func
        gate = self.gate_proj[layer_id]

        def language(x):
            return mlp.dense_4h_to_h(act(gate(x)) * mlp.dense_h_to_4h(x))

        def vision(x):
            key = str(layer_id)
            up = self.vision_dense_h_to_4h_list[key](x)
            return self.vision_dense_4h_to_h_list[key](act(self.vision_gate_proj[key](x)) * up)

        mask = expert_mask_for(layer_id, self.vision_layer_range, kw_args)
        return route(hidden_states, mask, language, vision).contiguous()

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
        world_size = mpu.get_model_parallel_world_size()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_heads
        self.hidden_size_per_attention_head = divide(hidden_size, num_heads)
        self.num_attention_heads_per_partition = divide(num_heads, world_size)
        self.inner_hidden_size = num_heads * self.hidden_size_per_attention_head
        # upstream: pos_idx_in_fp32=False (positions in the buffer's dtype, as the released weights saw)
        self.rotary_emb = FastRotaryEmbedding(hidden_size // num_heads, pos_idx_in_fp32=False, device=place.device)
        self.num_vision_layers = num_vision_layers
        self.num_layers = num_layers
        self.vision_layer_range = vision_layers(num_layers, num_vision_layers, vision_layer_range)
        self.use_vision_expert = use_vision_expert
        if use_vision_expert:
            self.vision_query_key_value_list = _expert_dict(self.vision_layer_range, lambda: ColumnParallelLinear(
                hidden_size, 3 * hidden_size, stride=3, gather_output=False, bias=False,
                module=self, name="vision_query_key_value", **place.parallel_kwargs()))
            self.vision_dense_list = _expert_dict(self.vision_layer_range, lambda: RowParallelLinear(
                self.inner_hidden_size, hidden_size, input_is_parallel=True, bias=False, final_bias=False,
                module=self, name="vision_dense", **place.parallel_kwargs(output_layer=True)))

    def attention_forward(self, hidden_states, mask, **kw_args):
        layer_id = int(kw_args["layer_id"])
        attention = self.transformer.layers[layer_id].attention
        attention_fn = attention.hooks.get("attention_fn", attention_fn_default)
        key = str(layer_id)
        expert_mask = (expert_mask_for(layer_id, self.vision_layer_range, kw_args)
                       if self.use_vision_expert else None)

        mixed = route(hidden_states, expert_mask, attention.query_key_value,
                      lambda x: self.vision_query_key_value_list[key](x))
        query, key_layer, value = (attention._transpose_for_scores(t)
                                   for t in split_tensor_along_last_dim(mixed, 3))
        position_ids = kw_args["position_ids"]
        query, key_layer = self.rotary_emb(query, key_layer, position_ids, max_seqlen=position_ids.max() + 1,
                                           layer_id=kw_args["layer_id"])
        dropout_fn = attention.attention_dropout if attention.training else None
        context = attention_fn(query, key_layer, value, mask, dropout_fn, **kw_args)
        context = context.permute(0, 2, 1, 3).contiguous()
        context = context.view(*context.shape[:-2], attention.hidden_size_per_partition)

        output = route(context, expert_mask, attention.dense, lambda x: self.vision_dense_list[key](x))
        if attention.training:
            output = attention.output_dropout(output)
        return output.contiguous()

    def copy_param(self):
        """Initialise each expert from its layer's language weights (upstream ``copy_param``)."""
        with torch.no_grad():
            for i in self.vision_layer_range:
                attention = self.transformer.layers[i].attention
                self.vision_query_key_value_list[str(i)].weight.copy_(attention.query_key_value.weight)
                self.vision_dense_list[str(i)].weight.copy_(attention.dense.weight)
