"""CogVLM and CogAgent as SAT models (registered in SAT's model registry by class name).

Mirrors ``CogVLMModel``/``FineTuneTrainCogVLMModel`` of CogVLM ``utils/models/cogvlm_model.py`` and
``CogAgentModel``/``FineTuneTrainCogAgentModel`` of ``utils/models/cogagent_model.py``: a LLaMA
language model whose ``mlp`` and ``rotary`` mixins are the vision-expert ones, an ``eva`` mixin
(EVA2-CLIP + GLU) filling the image slots of the input, and for CogAgent an ``encoder`` mixin (the
EVA2-CLIP-L high-resolution encoder) feeding SAT's per-layer cross attention
(``is_decoder``, ``cross_attn_hidden_size``, ``cross_hidden_size_per_attention_head``).

State-dict keys and ``model_config.json`` fields are upstream's, so ``--from_pretrained
cogvlm-base-490`` / ``cogagent-chat`` with the released weights load into these classes. All parts
are built in the transformer's dtype/device (see :mod:`.placement`); upstream's ``parallel_output``
constructor argument is accepted for old callers (SAT >= 0.4.12 reads it from ``args``).
"""
from __future__ import annotations

import json

import torch

from sat.model.official.llama_model import LLaMAModel

from ..core.kinds import KINDS
from .eva_clip_large import ExternalVisionModel, encoder_config
from .image_mixin import ImageMixin
from .llama import init_llama_base
from .vision_expert import LlamaVisionExpertAttnMixin, LlamaVisionExpertFCMixin

NUM_VISION_LAYERS = 32  # upstream passes 32: every layer of the 32-layer LLaMA has experts


def _check_image_length(args):
    eva = getattr(args, "eva_args", None) or {}
    if "image_size" not in eva or "patch_size" not in eva:
        raise ValueError("args.eva_args must describe the EVA tower (image_size, patch_size, hidden_size, ...): "
                         "load a model_config.json (--from_pretrained) or use tiny_args()")
    size, patch = eva["image_size"], eva["patch_size"]
    expected = (size[0] // patch) * (size[1] // patch)
    if args.image_length != expected:
        raise ValueError(f"image_length {args.image_length} does not match eva_args image_size {size} / "
                         f"patch_size {patch} = {expected} tokens")


def _add_vision_mixins(model, args, placement, cogagent):
    """The ``eva``, ``mlp`` and ``rotary`` mixins shared by CogVLM and CogAgent (the last two of the classes
    ``model.vision_expert_mixins``: a CogVLM fork's model code brings its own)."""
    fc_mixin, attention_mixin = model.vision_expert_mixins
    place = dict(params_dtype=placement.params_dtype, device=placement.device)
    model.add_mixin("eva", ImageMixin(args, skip_init=placement.skip_init, with_pos_embed=cogagent, **place))
    inits = dict(skip_init=placement.skip_init, init_method=placement.init_method,
                 output_layer_init_method=placement.output_layer_init_method, **place)
    model.add_mixin("mlp", fc_mixin(args.hidden_size, args.inner_hidden_size, args.num_layers,
                                                    NUM_VISION_LAYERS, **inits))
    model.add_mixin("rotary", attention_mixin(args.hidden_size, args.num_attention_heads,
                                                         args.num_layers, NUM_VISION_LAYERS, **inits))


def _add_finetune_args(parser, title):
    group = parser.add_argument_group(title, f"{title} Configurations")
    group.add_argument("--pre_seq_len", type=int, default=8)
    group.add_argument("--lora_rank", type=int, default=10)
    group.add_argument("--use_ptuning", action="store_true")
    group.add_argument("--use_lora", action="store_true")
    group.add_argument("--use_qlora", action="store_true")
    group.add_argument("--layer_range", nargs="+", type=int, default=None)
    return parser


class CogVLMModel(LLaMAModel):
    vision_expert_mixins = (LlamaVisionExpertFCMixin, LlamaVisionExpertAttnMixin)

    def __init__(self, args, transformer=None, params_dtype=torch.float, parallel_output=None, **kwargs):
        _check_image_length(args)
        placement = init_llama_base(self, args, transformer=transformer, params_dtype=params_dtype,
                                    parallel_output=parallel_output, **kwargs)
        self.image_length = args.image_length
        _add_vision_mixins(self, args, placement, cogagent=False)

    @classmethod
    def add_model_specific_args(cls, parser):
        group = parser.add_argument_group("CogVLM", "CogVLM Configurations")
        group.add_argument("--image_length", type=int, default=256)
        group.add_argument("--eva_args", type=json.loads, default={})
        return super().add_model_specific_args(parser)

    def forward(self, input_ids, vision_expert_mask=None, image_embed_mask=None, **kwargs):
        if input_ids.shape[1] > 1:
            return super().forward(input_ids=input_ids, vision_expert_mask=vision_expert_mask,
                                   image_embed_mask=image_embed_mask, **kwargs)
        return super().forward(input_ids=input_ids, **kwargs)


class FineTuneTrainCogVLMModel(CogVLMModel):
    """CogVLM for ``training_main``; LoRA/P-tuning mixins are added by the training script after
    loading (upstream: so that model-parallel loading of an MP=1 checkpoint works)."""

    def __init__(self, args, transformer=None, **kwargs):
        super().__init__(args, transformer=transformer, **kwargs)
        self.args = args

    @classmethod
    def add_model_specific_args(cls, parser):
        _add_finetune_args(parser, "CogVLM-finetune")
        return super().add_model_specific_args(parser)


class CogAgentModel(LLaMAModel):
    vision_expert_mixins = (LlamaVisionExpertFCMixin, LlamaVisionExpertAttnMixin)

    def __init__(self, args, transformer=None, params_dtype=torch.float, parallel_output=None, **kwargs):
        _check_image_length(args)
        width = encoder_config(getattr(args, "encoder_args", None))["width"]
        if not getattr(args, "is_decoder", False) or getattr(args, "cross_attn_hidden_size", None) != width:
            raise ValueError(f"CogAgent needs is_decoder and cross_attn_hidden_size == encoder width {width} "
                             f"(got is_decoder={getattr(args, 'is_decoder', None)}, "
                             f"cross_attn_hidden_size={getattr(args, 'cross_attn_hidden_size', None)})")
        placement = init_llama_base(self, args, transformer=transformer, params_dtype=params_dtype,
                                    parallel_output=parallel_output, **kwargs)
        self.image_length = args.image_length
        self.cross_image_pix = args.cross_image_pix
        _add_vision_mixins(self, args, placement, cogagent=True)
        self.add_mixin("encoder", ExternalVisionModel(args.cross_image_pix, getattr(args, "encoder_args", None),
                                                      params_dtype=placement.params_dtype, device=placement.device,
                                                      skip_init=placement.skip_init))

    @classmethod
    def add_model_specific_args(cls, parser):
        group = parser.add_argument_group("CogAgent", "CogAgent Configurations")
        group.add_argument("--image_length", type=int, default=256)
        group.add_argument("--cross_image_pix", type=int, default=1120)
        group.add_argument("--eva_args", type=json.loads, default={})
        group.add_argument("--encoder_args", type=json.loads, default={},
                           help="high-resolution encoder sizes; {} means upstream's EVA2-CLIP-L")
        return super().add_model_specific_args(parser)

    def forward(self, input_ids, vision_expert_mask=None, image_embed_mask=None, **kwargs):
        cross_inputs = {k[len("cross_"):]: v for k, v in kwargs.items() if k.startswith("cross_")}
        if kwargs.get("mems_cross") is not None:
            kwargs["encoder_outputs"] = kwargs["mems_cross"][0]
        else:
            kwargs["encoder_outputs"] = self.get_mixin("encoder")(**cross_inputs)
        if "attention_mask" not in cross_inputs:
            raise ValueError("CogAgent needs cross_attention_mask (the cross image processor's attention_mask)")
        kwargs["cross_attention_mask"] = cross_inputs["attention_mask"]
        if input_ids.shape[1] > 1:
            return super().forward(input_ids=input_ids, vision_expert_mask=vision_expert_mask,
                                   image_embed_mask=image_embed_mask, **kwargs)
        return super().forward(input_ids=input_ids, **kwargs)


class FineTuneTrainCogAgentModel(CogAgentModel):
    def __init__(self, args, transformer=None, **kwargs):
        super().__init__(args, transformer=transformer, **kwargs)
        self.args = args

    @classmethod
    def add_model_specific_args(cls, parser):
        _add_finetune_args(parser, "CogAgent-finetune")
        return super().add_model_specific_args(parser)


def model_class_for(kind_or_name: str, finetune: bool = True):
    name = KINDS[kind_or_name].model_class if kind_or_name in KINDS else kind_or_name
    if finetune and not name.startswith("FineTuneTrain"):
        name = "FineTuneTrain" + name
    return globals()[name]
