"""The ``eva`` mixin: EVA2-CLIP tower + GLU projector whose output fills the image slots of the language
model's input embedding (upstream ``GLU``, ``override_dist_dtype_device_args`` and ``ImageMixin``, with
their parameter names; CogAgent's variant adds ``pos_embed``). The projector's input width is the EVA
config's ``hidden_size`` (upstream hard-codes 1792), so smaller towers work."""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from sat.model.base_model import BaseMixin

from ..planning.timing import eva_skip_layers
from .eva_clip import EVA2CLIPModel
from .placement import Placement, make_module, zeros_parameter


class GLU(nn.Module):
    """``linear_proj`` -> LayerNorm -> GELU -> SiLU-gated MLP (``gate_proj``/``dense_h_to_4h``/``dense_4h_to_h``)."""

    def __init__(self, in_features, hidden_size, inner_hidden_size, placement: Placement):
        super().__init__()
        self.linear_proj = make_module(placement, nn.Linear, in_features, hidden_size, bias=False)
        self.norm1 = make_module(placement, nn.LayerNorm, hidden_size)
        self.act1 = nn.GELU()
        self.act2 = nn.functional.silu
        self.dense_h_to_4h = make_module(placement, nn.Linear, hidden_size, inner_hidden_size, bias=False)
        self.gate_proj = make_module(placement, nn.Linear, hidden_size, inner_hidden_size, bias=False)
        self.dense_4h_to_h = make_module(placement, nn.Linear, inner_hidden_size, hidden_size, bias=False)

    def forward(self, x):
        x = self.act1(self.norm1(self.linear_proj(x)))
        return self.dense_4h_to_h(self.act2(self.gate_proj(x)) * self.dense_h_to_4h(x))


_RUN_DEFAULTS = {"world_size": 1, "rank": 0, "local_rank": 0, "skip_init": False,
                 "use_gpu_initialization": False, "deepspeed": False, "bf16": False, "fp16": False,
                 "mode": "inference", "device": "cpu"}


def vision_args(args, eva_args: dict) -> argparse.Namespace:
    """The EVA tower's arguments (a copy): the checkpoint's ``eva_args`` plus the run's distributed/dtype/device
    settings (upstream ``override_dist_dtype_device_args``). Outside inference: no dropout, checkpointing per
    ``--vit_checkpoint_activations``, and its last ``--vit_checkpoint_skip_layers`` layers not checkpointed
    (default: the share ``--checkpoint-skip-layers`` leaves out of the language model)."""
    run = {k: getattr(args, k, default) for k, default in _RUN_DEFAULTS.items()}
    if run["mode"] != "inference":
        run["checkpoint_activations"] = getattr(args, "vit_checkpoint_activations",
                                                getattr(args, "checkpoint_activations", False))
        run["checkpoint_num_layers"] = getattr(args, "checkpoint_num_layers", 1)
        skip = getattr(args, "vit_checkpoint_skip_layers", None)
        if skip is None and getattr(args, "checkpoint_skip_layers", 0) and "num_layers" in eva_args:
            skip = eva_skip_layers(args.checkpoint_skip_layers, args.num_layers, eva_args["num_layers"])
        run["checkpoint_skip_layers"] = skip or 0
        run.update(hidden_dropout=0.0, attention_dropout=0.0)
    merged = copy.deepcopy(dict(eva_args))
    if hasattr(args, "model_parallel_size"):
        merged["model_parallel_size"] = args.model_parallel_size
    merged.update(run)
    return argparse.Namespace(**merged)


class ImageMixin(BaseMixin):
    def __init__(self, args, params_dtype=None, device=None, skip_init=None, with_pos_embed=False):
        super().__init__()
        skip_init = getattr(args, "skip_init", False) if skip_init is None else skip_init
        placement = Placement.resolve(params_dtype, device, skip_init)
        eva_args = args.eva_args
        vit_args = EVA2CLIPModel.get_args(**vars(vision_args(args, eva_args)))
        self.vit_model = EVA2CLIPModel(vit_args, params_dtype=placement.params_dtype)
        self.in_features = eva_args["hidden_size"]  # upstream: 1792
        self.linear_proj = GLU(self.in_features, args.hidden_size, args.inner_hidden_size, placement)
        self.image_length = args.image_length
        self.boi = zeros_parameter(placement, 1, 1, args.hidden_size)
        self.eoi = zeros_parameter(placement, 1, 1, args.hidden_size)
        self.pos_embed = zeros_parameter(placement, self.image_length, self.in_features) if with_pos_embed else None

    def word_embedding_forward(self, input_ids, output_cross_layer, **kw_args):
        vision_inputs = {k[len("vision_"):]: v for k, v in kw_args.items()
                         if k.startswith("vision_") and k != "vision_expert_mask"}
        if input_ids.shape[1] == 1 or not vision_inputs:
            return self.transformer.word_embeddings(input_ids)
        image_emb = self.vit_model(**vision_inputs)[0]
        if self.pos_embed is not None:
            image_emb = image_emb + self.pos_embed.unsqueeze(0)
        image_emb = self.linear_proj(image_emb)
        batch = image_emb.shape[0]
        with_markers = torch.cat([self.boi.expand(batch, -1, -1), image_emb, self.eoi.expand(batch, -1, -1)], dim=1)
        embeddings = self.transformer.word_embeddings(input_ids).clone()
        slots = kw_args["image_embed_mask"].bool()
        if int(slots.sum()) != with_markers.shape[0] * with_markers.shape[1]:
            raise ValueError(f"image_embed_mask marks {int(slots.sum())} positions; {batch} image(s) of "
                             f"{self.image_length} tokens need {with_markers.shape[0] * with_markers.shape[1]} "
                             f"(image_length + 2 each)")
        embeddings[slots] = with_markers.reshape(-1, with_markers.shape[-1]).to(embeddings.dtype)
        return embeddings.contiguous()
