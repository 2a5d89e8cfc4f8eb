"""A CogVLM-architecture-like SAT model for tests and benchmarks: LLaMA plus vision-expert layers.

Like CogVLM's ``LlamaVisionExpertFCMixin``/``LlamaVisionExpertAttnMixin``, the expert mixins build SAT
parallel layers with ``params_dtype=torch.float, device=torch.device('cpu')`` defaults, and the model
replaces LLaMA's own MLP mixin (built and initialised first, then discarded, as CogVLM does). Each
layer has language and vision weights for the gate, the MLP and the attention (fused qkv with
``stride=3``, so ColumnParallel ``stride`` slicing is exercised). Tokens flagged by ``vision_mask``
take the vision MLP. ``lora_rank`` > 0 adds SAT's ``LoraMixin`` to every layer's attention.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
from sat.model.base_model import BaseMixin
from sat.model.finetune.lora2 import LoraMixin
from sat.model.official.llama_model import LLaMAModel
from sat.mpu import ColumnParallelLinear, RowParallelLinear


def model_class():

    class VisionExpertFCMixin(BaseMixin):
        def __init__(self, in_features, hidden_features, num_layers, num_vision_layers,
                     params_dtype=torch.float, device=torch.device("cpu")):
            super().__init__()
            col = dict(gather_output=False, bias=False, params_dtype=params_dtype, module=self,
                       skip_init=True, device=device)
            self.gate_proj = nn.ModuleList([ColumnParallelLinear(in_features, hidden_features, name="gate", **col)
                                            for _ in range(num_layers)])
            self.vision_gate_proj = nn.ModuleList([ColumnParallelLinear(in_features, hidden_features, name="vgate", **col)
                                                   for _ in range(num_vision_layers)])
            self.vision_dense_h_to_4h = nn.ModuleList([ColumnParallelLinear(in_features, hidden_features, name="vh4h", **col)
                                                       for _ in range(num_vision_layers)])
            self.vision_dense_4h_to_h = nn.ModuleList([
                RowParallelLinear(hidden_features, in_features, input_is_parallel=True, bias=False,
                                  params_dtype=params_dtype, module=self, name="v4hh", skip_init=True, device=device)
                for _ in range(num_vision_layers)])

        def mlp_forward(self, hidden_states, layer_id=None, vision_mask=None, **kw_args):
            mlp = self.transformer.layers[layer_id].mlp
            out = mlp.dense_4h_to_h(mlp.activation_func(self.gate_proj[layer_id](hidden_states))
                                    * mlp.dense_h_to_4h(hidden_states))
            if vision_mask is not None and layer_id < len(self.vision_gate_proj):
                vision = self.vision_dense_4h_to_h[layer_id](
                    mlp.activation_func(self.vision_gate_proj[layer_id](hidden_states))
                    * self.vision_dense_h_to_4h[layer_id](hidden_states))
                out = torch.where(vision_mask.unsqueeze(-1), vision, out)
            return out

    class VisionExpertAttnMixin(BaseMixin):
        def __init__(self, hidden_size, num_vision_layers, params_dtype=torch.float, device=torch.device("cpu")):
            super().__init__()
            self.vision_query_key_value = nn.ModuleList([
                ColumnParallelLinear(hidden_size, 3 * hidden_size, stride=3, gather_output=False, bias=True,
                                     params_dtype=params_dtype, module=self, name="vqkv", skip_init=True, device=device)
                for _ in range(num_vision_layers)])
            self.vision_dense = nn.ModuleList([
                RowParallelLinear(hidden_size, hidden_size, input_is_parallel=True, bias=False,
                                  params_dtype=params_dtype, module=self, name="vdense", skip_init=True, device=device)
                for _ in range(num_vision_layers)])

    class ExpertLLaMA(LLaMAModel):
        def __init__(self, args, transformer=None, **kwargs):
            super().__init__(args, transformer=transformer, **kwargs)
            vision_layers = getattr(args, "num_vision_layers", args.num_layers)
            self.del_mixin("mlp")
            self.add_mixin("mlp", VisionExpertFCMixin(args.hidden_size, args.inner_hidden_size, args.num_layers,
                                                      vision_layers))
            self.add_mixin("attn", VisionExpertAttnMixin(args.hidden_size, vision_layers))
            if getattr(args, "lora_rank", 0):
                self.add_mixin("lora", LoraMixin(args.num_layers, args.lora_rank), reinit=True)

        @classmethod
        def add_model_specific_args(cls, parser):
            super().add_model_specific_args(parser)
            group = parser.add_argument_group("ExpertLLaMA")
            group.add_argument("--num-vision-layers", type=int, default=1)
            group.add_argument("--lora-rank", type=int, default=0, help="LoRA on attention (0: none)")
            return parser

    return ExpertLLaMA


def config(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024, inner_hidden_size=128,
           num_vision_layers=1, **extra) -> dict:
    """A model_config.json for :func:`model_class` (vocab >= 1000: SAT's MP vocab embedding)."""
    return dict(model_class="ExpertLLaMA", num_layers=num_layers, hidden_size=hidden_size,
                num_attention_heads=num_attention_heads, vocab_size=vocab_size,
                inner_hidden_size=inner_hidden_size, num_vision_layers=num_vision_layers,
                max_sequence_length=256, layernorm_order="pre", model_parallel_size=1,
                layernorm_epsilon=1e-6, use_bias=False, **extra)


def build_args(cfg: dict, **overrides):
    """An args namespace for :func:`model_class` from a config dict, model-only (no training args)."""
    cls = model_class()
    args = cls.get_args(**{**cfg, **overrides})
    return args


def fill_(model: nn.Module, seed: int = 0) -> None:
    """Give every parameter cheap, distinct, deterministic values (uniform in [-0.05, 0.05])."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05, generator=g)


def write_checkpoint(model: nn.Module, cfg: dict, path: str, iteration: int = 1, mp_rank: int = 0,
                     dtype=None) -> str:
    """Write SAT's checkpoint layout (``latest``, ``model_config.json``, ``<it>/mp_rank_XX_model_states.pt``)."""
    sub = os.path.join(path, str(iteration))
    os.makedirs(sub, exist_ok=True)
    sd = model.state_dict()
    if dtype is not None:
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    torch.save({"module": sd, "iteration": iteration}, os.path.join(sub, f"mp_rank_{mp_rank:02d}_model_states.pt"))
    if mp_rank == 0:
        with open(os.path.join(path, "latest"), "w") as f:
            f.write(str(iteration))
        with open(os.path.join(path, "model_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    return path
