"""EVA2-CLIP vision tower of CogVLM (upstream ``utils/models/eva_clip_model.py``) as a SAT ``BaseModel``, with
upstream's parameter names. Attention is SAT's default instead of xformers, which has no CPU kernels."""
from __future__ import annotations

import torch
from torch import nn

from sat.model.base_model import BaseMixin, BaseModel
from sat.model.official.eva_clip_model import EVA2CLIPModel as _SAT_EVA2CLIPModel
from sat.model.official.vit_model import InterpolatedPositionEmbeddingMixin, ViTProperty, gelu
from sat.model.registry import model_registry

from .placement import Placement, make_module

class PatchEmbeddingMixin(BaseMixin):
    """[pre tokens from the word embedding] + conv patches + [post tokens]: ``proj`` is the conv."""

    def __init__(self, in_channels, hidden_size, property: ViTProperty, placement: Placement):
        super().__init__()
        self.proj = make_module(placement, nn.Conv2d, in_channels, hidden_size,
                                kernel_size=property.patch_size, stride=property.patch_size)

    def word_embedding_forward(self, input_ids, **kwargs):
        prop = self.transformer.property
        image = kwargs["image"].to(self.proj.weight.dtype)
        patches = self.proj(image).flatten(2).transpose(1, 2)
        pre = self.transformer.word_embeddings(input_ids[:, :prop.pre_len])
        post = self.transformer.word_embeddings(input_ids[:, prop.pre_len:prop.pre_len + prop.post_len])
        return torch.cat([pre, patches, post], dim=1)


class DropClsMixin(BaseMixin):
    """Final hook: drop the [CLS] token (upstream ``IdentityMixin``)."""

    def final_forward(self, logits, **kwargs):
        return logits[:, 1:]


class ResidualPostNormMixin(BaseMixin):
    """EVA2-CLIP layer: ``x + LN(attn(x))`` then ``x + LN(mlp(x))`` (upstream ``NewLayerForward``).
    The layer's ``input_layernorm`` normalises the attention output, ``post_attention_layernorm``
    the MLP output. Drop path is not implemented (CogVLM sets it to 0)."""

    def layer_forward(self, hidden_states, mask, *args, **kw_args):
        layer = self.transformer.layers[kw_args["layer_id"]]
        hidden_states = hidden_states + layer.input_layernorm(layer.attention(hidden_states, mask, **kw_args))
        return hidden_states + layer.post_attention_layernorm(layer.mlp(hidden_states, **kw_args))


class EVA2CLIPModel(BaseModel):
    """EVA2-CLIP-E as CogVLM builds it: ``eva_args`` of the checkpoint (``image_size``, ``patch_size``,
    ``pre_len``, ``post_len``, ``in_channels`` plus the usual SAT transformer sizes)."""

    def __init__(self, args, transformer=None, params_dtype=torch.float, **kwargs):
        property = ViTProperty(args.image_size, args.patch_size, args.pre_len, args.post_len)
        args.max_sequence_length = property.seq_len
        kwargs.setdefault("activation_func", gelu)
        super().__init__(args, transformer=transformer, params_dtype=params_dtype, **kwargs)
        self.transformer.property = property
        placement = Placement.of_transformer(self.transformer, getattr(args, "skip_init", False))
        self.add_mixin("patch_embedding", PatchEmbeddingMixin(args.in_channels, args.hidden_size, property, placement))
        self.add_mixin("pos_embedding", InterpolatedPositionEmbeddingMixin())
        self.add_mixin("final", DropClsMixin())
        self.add_mixin("newpost", ResidualPostNormMixin())

    @classmethod
    def add_model_specific_args(cls, parser):
        group = parser.add_argument_group("EVA2CLIP", "EVA2CLIP Configurations")
        group.add_argument("--image-size", nargs="+", type=int, default=[224, 224])
        group.add_argument("--pre-len", type=int, default=1)
        group.add_argument("--post-len", type=int, default=0)
        group.add_argument("--in-channels", type=int, default=3)
        group.add_argument("--patch-size", type=int, default=16)
        return parser


# SAT's registry keys classes by name: SAT's own EVA2CLIPModel stays registered (ImageMixin builds ours directly).
model_registry.member["EVA2CLIPModel"] = _SAT_EVA2CLIPModel
