"""CogVLM and CogAgent as SAT models (upstream ``utils/models/cogvlm_model.py``, ``cogagent_model.py``): a LLaMA
whose ``mlp`` and ``rotary`` mixins have vision experts, an ``eva`` mixin filling the image slots, and for
CogAgent an ``encoder`` mixin feeding SAT's cross attention. State-dict keys and ``model_config.json``
fields are upstream's, so the released SAT checkpoints load.
"""
from __future__ import annotations

import json

import torch

from sat.model.official.llama_model import LLaMAModel

from ..core.kinds import KINDS
from .eva_clip_large import ExternalVisionModel, encoder_config
from .image_mixin import ImageMixin
from .llama import init_llama_base
from .placement import Placement
from .vision_expert import LlamaVisionExpertAttnMixin, LlamaVisionExpertFCMixin

NUM_VISION_LAYERS = 32  # upstream passes 32: every layer of the 32-layer LLaMA has experts


class CogVLMModel(LLaMAModel):
    vision_expert_mixins = (LlamaVisionExpertFCMixin, LlamaVisionExpertAttnMixin)  # a fork's model code brings its own
    title = "CogVLM"
    cogagent = False  # CogAgent: a learned pos_embed on the image features, and the ``encoder`` mixin

    def __init__(self, args, transformer=None, params_dtype=torch.float, parallel_output=None, **kwargs):
        eva = getattr(args, "eva_args", None) or {}
        if not {"image_size", "patch_size", "hidden_size"} <= set(eva):
            raise ValueError("args.eva_args must describe the EVA tower (image_size, patch_size, hidden_size, ...): "
                             "load a model_config.json (--from_pretrained) or use tiny_args()")
        size, patch = eva["image_size"], eva["patch_size"]
        expected = (size[0] // patch) * (size[1] // patch)
        if args.image_length != expected:
            raise ValueError(f"image_length {args.image_length} does not match eva_args image_size {size} / "
                             f"patch_size {patch} = {expected} tokens")
        placement = init_llama_base(self, args, transformer=transformer, params_dtype=params_dtype,
                                    parallel_output=parallel_output, **kwargs)
        self.image_length = args.image_length
        fc_mixin, attention_mixin = self.vision_expert_mixins
        place = dict(params_dtype=placement.params_dtype, device=placement.device)
        self.add_mixin("eva", ImageMixin(args, skip_init=placement.skip_init, with_pos_embed=self.cogagent, **place))
        inits = dict(skip_init=placement.skip_init, init_method=placement.init_method,
                     output_layer_init_method=placement.output_layer_init_method, **place)
        self.add_mixin("mlp", fc_mixin(args.hidden_size, args.inner_hidden_size, args.num_layers,
                                       NUM_VISION_LAYERS, **inits))
        self.add_mixin("rotary", attention_mixin(args.hidden_size, args.num_attention_heads,
                                                 args.num_layers, NUM_VISION_LAYERS, **inits))

    @classmethod
    def add_model_specific_args(cls, parser):
        group = parser.add_argument_group(cls.title, f"{cls.title} Configurations")
        group.add_argument("--image_length", type=int, default=256)
        if cls.cogagent:
            group.add_argument("--cross_image_pix", type=int, default=1120)
        group.add_argument("--eva_args", type=json.loads, default={})
        if cls.cogagent:
            group.add_argument("--encoder_args", type=json.loads, default={},
                               help="high-resolution encoder sizes; {} means upstream's EVA2-CLIP-L")
        return super().add_model_specific_args(parser)

    def forward(self, input_ids, vision_expert_mask=None, image_embed_mask=None, **kwargs):
        if input_ids.shape[1] > 1:
            kwargs.update(vision_expert_mask=vision_expert_mask, image_embed_mask=image_embed_mask)
        return super().forward(input_ids=input_ids, **kwargs)


class CogAgentModel(CogVLMModel):
    title = "CogAgent"
    cogagent = True

    def __init__(self, args, transformer=None, **kwargs):
        width = encoder_config(getattr(args, "encoder_args", None))["width"]
        if not getattr(args, "is_decoder", False) or getattr(args, "cross_attn_hidden_size", None) != width:
            raise ValueError(f"CogAgent needs is_decoder and cross_attn_hidden_size == encoder width {width} "
                             f"(got is_decoder={getattr(args, 'is_decoder', None)}, "
                             f"cross_attn_hidden_size={getattr(args, 'cross_attn_hidden_size', None)})")
        super().__init__(args, transformer=transformer, **kwargs)
        self.cross_image_pix = args.cross_image_pix
        placement = Placement.of_transformer(self.transformer, getattr(args, "skip_init", False))
        self.add_mixin("encoder", ExternalVisionModel(args.cross_image_pix, getattr(args, "encoder_args", None),
                                                      params_dtype=placement.params_dtype, device=placement.device,
                                                      skip_init=placement.skip_init))

    def forward(self, input_ids, **kwargs):
        cross_inputs = {k[len("cross_"):]: v for k, v in kwargs.items() if k.startswith("cross_")}
        if kwargs.get("mems_cross") is not None:
            kwargs["encoder_outputs"] = kwargs["mems_cross"][0]
        else:
            kwargs["encoder_outputs"] = self.get_mixin("encoder")(**cross_inputs)
        if "attention_mask" not in cross_inputs:
            raise ValueError("CogAgent needs cross_attention_mask (the cross image processor's attention_mask)")
        kwargs["cross_attention_mask"] = cross_inputs["attention_mask"]
        return super().forward(input_ids, **kwargs)


class _FineTuneTrain:
    """``training_main``'s classes; LoRA/P-tuning mixins are added by the training script after loading
    (upstream: so that model-parallel loading of an MP=1 checkpoint works)."""

    def __init__(self, args, transformer=None, **kwargs):
        super().__init__(args, transformer=transformer, **kwargs)
        self.args = args

    @classmethod
    def add_model_specific_args(cls, parser):
        group = parser.add_argument_group(f"{cls.title}-finetune", f"{cls.title}-finetune Configurations")
        group.add_argument("--pre_seq_len", type=int, default=8)
        group.add_argument("--lora_rank", type=int, default=10)
        group.add_argument("--use_ptuning", action="store_true")
        group.add_argument("--use_lora", action="store_true")
        group.add_argument("--use_qlora", action="store_true")
        group.add_argument("--layer_range", nargs="+", type=int, default=None)
        return super().add_model_specific_args(parser)


class FineTuneTrainCogVLMModel(_FineTuneTrain, CogVLMModel):
    pass


class FineTuneTrainCogAgentModel(_FineTuneTrain, CogAgentModel):
    pass


def model_class_for(kind_or_name: str, finetune: bool = True):
    name = KINDS[kind_or_name].model_class if kind_or_name in KINDS else kind_or_name
    if finetune and not name.startswith("FineTuneTrain"):
        name = "FineTuneTrain" + name
    return globals()[name]
