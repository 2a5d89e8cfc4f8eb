"""A synthetic CogVLM checkout for tests: upstream's layout and entry points, our own short code.

``write_fake_checkout(dest)`` writes, under ``dest``::

    finetune_demo/finetune_cogvlm_demo.py     upstream's options and flow: FineTuneTrainCogVLMModel
    finetune_demo/finetune_cogagent_demo.py   from utils.models, LoRA on the language model and on
                                              EVA, training_main(...), then the LoRA merged and the
                                              model saved to checkpoints/merged_lora_cog{vlm<px>,agent}
    utils/models/__init__.py                  CogVLMModel, FineTuneTrainCogVLMModel, CogAgentModel,
    utils/models/cogvlm_model.py              FineTuneTrainCogAgentModel
    utils/models/cogagent_model.py
    utils/models/mixin.py                     the vision-expert mixins, routing tokens with boolean masks
                                              in the shape of upstream's (what sat_patches' fork patches
                                              recognise and replace)
    utils/utils/__init__.py                   llama2_tokenizer, llama2_text_processor,
                                              get_image_processor, ItemDataset

so that tools meant for a real CogVLM checkout (or a fork of it) can be exercised end to end without
one. The models, data pipeline and tokenizer loader delegate to :mod:`sat_patches.cogvlm` (same
parameter names and checkpoint layout as upstream); the models add upstream's fixed EVA output width
(the image projector takes 1792 features whatever the config says), so a tiny checkpoint that would
not load into upstream's classes does not load here either. The demos run as ``__main__`` and use a
module-level ``tokenizer`` in their evaluation step, as upstream's do.
"""
from __future__ import annotations

import os
import textwrap

MODELS_INIT = '''\
from .cogvlm_model import CogVLMModel, FineTuneTrainCogVLMModel
from .cogagent_model import CogAgentModel, FineTuneTrainCogAgentModel
'''

MIXIN_FILE = '''\
"""Vision-expert mixins (synthetic checkout): parameters from sat_patches.cogvlm, forwards written here in the
shape of upstream's utils/models/mixin.py: tokens routed with boolean masks in every layer."""
import torch
from sat import mpu
from sat.transformer_defaults import attention_fn_default
from sat.mpu.utils import split_tensor_along_last_dim

from sat_patches.cogvlm import vision_expert as _impl


class LlamaVisionExpertFCMixin(_impl.LlamaVisionExpertFCMixin):
    def mlp_forward(self, hidden_states, **kw_args):
        mixin_self, self = self, self.transformer.layers[kw_args["layer_id"]].mlp
        vision_expert_mask = kw_args.get("vision_expert_mask")
        layer = kw_args["layer_id"]
        key = str(int(layer))

        def language(x):
            return self.dense_4h_to_h(self.activation_func(mixin_self.gate_proj[layer](x)) * self.dense_h_to_4h(x))

        if layer in mixin_self.vision_layer_range and vision_expert_mask is not None and vision_expert_mask.any():
            mask = vision_expert_mask.bool()
            output = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)
            output[~mask] = language(hidden_states[~mask])
            vision = hidden_states[mask]
            up = mixin_self.vision_dense_h_to_4h_list[key](vision)
            up *= self.activation_func(mixin_self.vision_gate_proj[key](vision))
            output[mask] = mixin_self.vision_dense_4h_to_h_list[key](up)
        else:
            output = language(hidden_states)
        return output.contiguous()


class LlamaVisionExpertAttnMixin(_impl.LlamaVisionExpertAttnMixin):
    def attention_forward(self, hidden_states, mask, **kw_args):
        mixin_self, self = self, self.transformer.layers[kw_args["layer_id"]].attention
        attention_fn = self.hooks.get("attention_fn", attention_fn_default)
        vision_expert_mask = kw_args.get("vision_expert_mask")
        key = str(int(kw_args["layer_id"]))
        routed = (mixin_self.use_vision_expert and kw_args["layer_id"] in mixin_self.vision_layer_range
                  and vision_expert_mask is not None and vision_expert_mask.any())
        if routed:
            expert = vision_expert_mask.bool()
            width = hidden_states.shape[-1] * 3 // mpu.get_model_parallel_world_size()
            mixed = torch.empty((*hidden_states.shape[:-1], width), dtype=hidden_states.dtype,
                                device=hidden_states.device)
            mixed[~expert] = self.query_key_value(hidden_states[~expert])
            mixed[expert] = mixin_self.vision_query_key_value_list[key](hidden_states[expert])
        else:
            mixed = self.query_key_value(hidden_states)
        query, key_layer, value = (self._transpose_for_scores(t) for t in split_tensor_along_last_dim(mixed, 3))
        position_ids = kw_args["position_ids"]
        query, key_layer = mixin_self.rotary_emb(query, key_layer, position_ids, max_seqlen=position_ids.max() + 1,
                                                 layer_id=kw_args["layer_id"])
        context = attention_fn(query, key_layer, value, mask, self.attention_dropout if self.training else None,
                               **kw_args)
        context = context.permute(0, 2, 1, 3).contiguous()
        context = context.view(*context.shape[:-2], self.hidden_size_per_partition)
        if routed:
            output = torch.empty((*context.shape[:-1], hidden_states.shape[-1]), dtype=hidden_states.dtype,
                                 device=hidden_states.device)
            output[~expert] = self.dense(context[~expert])
            output[expert] = mixin_self.vision_dense_list[key](context[expert])
        else:
            output = self.dense(context)
        if self.training:
            output = self.output_dropout(output)
        return output.contiguous()
'''

MODEL_FILE = '''\
"""{kind} as SAT models (synthetic checkout: the layers come from sat_patches.cogvlm, the vision-expert mixins
from this checkout's mixin.py)."""
from sat_patches.cogvlm import models as _impl
from .mixin import LlamaVisionExpertAttnMixin, LlamaVisionExpertFCMixin

EVA_OUTPUT_WIDTH = 1792  # fixed in upstream's ImageMixin (self.in_features = 1792)


def _check_eva_width(args):
    width = args.eva_args.get("hidden_size")
    if width != EVA_OUTPUT_WIDTH:
        raise ValueError(f"eva_args.hidden_size is {{width}}, but the image projector takes {{EVA_OUTPUT_WIDTH}} "
                         f"features: keep eva_args.hidden_size {{EVA_OUTPUT_WIDTH}}")


class {base}(_impl.{base}):
    vision_expert_mixins = (LlamaVisionExpertFCMixin, LlamaVisionExpertAttnMixin)

    def __init__(self, args, transformer=None, **kwargs):
        _check_eva_width(args)
        super().__init__(args, transformer=transformer, **kwargs)


class FineTuneTrain{base}(_impl.FineTuneTrain{base}):
    vision_expert_mixins = (LlamaVisionExpertFCMixin, LlamaVisionExpertAttnMixin)

    def __init__(self, args, transformer=None, **kwargs):
        _check_eva_width(args)
        super().__init__(args, transformer=transformer, **kwargs)
'''

UTILS_INIT = '''\
from sat_patches.cogvlm import llama2_tokenizer, llama2_text_processor, get_image_processor, ItemDataset
'''

DEMO = '''\
"""Synthetic stand-in for CogVLM's finetune_demo/finetune_{kind}_demo.py (written by tests/support/fake_checkout.py)."""
import argparse
import os
import sys
from functools import partial

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sat import get_args
from sat.helpers import print_rank0
from sat.model.finetune.lora2 import LoraMixin
from sat.training.deepspeed_training import training_main
from utils.models import {model}
from utils.utils import ItemDataset, get_image_processor, llama2_text_processor

from sat_patches.cogvlm import data_collator
from sat_patches.cogvlm.trainer import forward_step, get_batch, lm_loss, model_inputs

ENABLE = {enable}  # beyond LoRA (upstream's CogVLM demo also trains EVA MLPs of layers 46-54: none in a tiny EVA)


def disable_untrainable_params(self):
    total = 0
    enable = list(ENABLE)
    if self.args.use_lora or self.args.use_qlora:
        enable += ["matrix_A", "matrix_B"]
    for n, p in self.named_parameters():
        if any(e.lower() in n.lower() for e in enable):
            total += p.numel()
        else:
            p.requires_grad_(False)
    print_rank0("***** Total trainable parameters: " + str(total) + " *****")


{model}.disable_untrainable_params = disable_untrainable_params


def forward_step_eval(data_iterator, model, args, timers):
    """Loss and exact-match accuracy of the argmax answer, decoded with the module-level tokenizer."""
    batch = get_batch(data_iterator, args, timers)
    labels = batch["labels"]
    logits = model(**model_inputs(batch))[0]
    loss = lm_loss(model, {{**model_inputs(batch), "labels": labels}})
    preds = logits[..., :-1, :].argmax(-1)[labels[..., 1:] != -100]
    answer = tokenizer.decode(preds.tolist(), skip_special_tokens=True)
    label = tokenizer.decode(labels[labels != -100].tolist(), skip_special_tokens=True)
    return loss, {{"acc": torch.tensor(float(answer == label), device=loss.device)}}


def create_dataset_function(image_processor, text_processor, cross_image_processor, path, args):
    return ItemDataset(image_processor, text_processor, args, path, cross_image_processor=cross_image_processor)


if __name__ == "__main__":
    py_parser = argparse.ArgumentParser(add_help=False)
    py_parser.add_argument("--max_length", type=int)
    py_parser.add_argument("--ignore_pad_token_for_loss", action="store_false")
    py_parser.add_argument("--version", type=str, default="{version}", help="version to interact with")
    py_parser.add_argument("--from_pretrained", type=str, default="{pretrained}", help="pretrained ckpt")
    py_parser.add_argument("--local_tokenizer", type=str, default="lmsys/vicuna-7b-v1.5", help="tokenizer path")
    py_parser.add_argument("--vit_checkpoint_activations", action="store_true")
    py_parser = {model}.add_model_specific_args(py_parser)
    known, args_list = py_parser.parse_known_args()
    args = get_args(args_list)
    args = argparse.Namespace(**vars(args), **vars(known))
    if args.use_qlora:
        args.device = "cpu"

    model, args = {model}.from_pretrained(
        args.from_pretrained, args,
        overwrite_args={{"model_parallel_size": args.model_parallel_size}} if args.model_parallel_size != 1 else {{}})
    if args.use_lora:
        model.add_mixin("lora", LoraMixin(args.num_layers, args.lora_rank, layer_range=args.layer_range), reinit=True)
        model.get_mixin("eva").vit_model.add_mixin(
            "lora", LoraMixin(args.eva_args["num_layers"], args.lora_rank, layer_range=args.layer_range), reinit=True)
    from utils.utils import llama2_tokenizer
    tokenizer = llama2_tokenizer(args.local_tokenizer, signal_type=args.version)
    image_processor = get_image_processor(args.eva_args["image_size"][0])
    cross_image_processor = {cross}
    text_processor = llama2_text_processor(tokenizer, args.max_length, args.image_length)

    model = training_main(
        args, model_cls=model, forward_step_function=forward_step,
        create_dataset_function=partial(create_dataset_function, image_processor, text_processor, cross_image_processor),
        collate_fn=partial(data_collator, cross_image_processor=cross_image_processor),
        forward_step_eval=forward_step_eval)
    if args.use_lora:
        model.get_mixin("lora").merge_lora()
        model.get_mixin("eva").vit_model.get_mixin("lora").merge_lora()
        args.use_lora = False
        args.save = {merged_save}
        from sat.training.model_io import save_checkpoint
        save_checkpoint(1, model, None, None, args)
'''

KINDS = {
    "cogvlm": dict(model="FineTuneTrainCogVLMModel", base="CogVLMModel", version="chat_old",
                   pretrained="cogvlm-chat", enable=[], cross="None",
                   merged_save='"checkpoints/merged_lora_cogvlm{}".format(args.eva_args["image_size"][0])'),
    "cogagent": dict(model="FineTuneTrainCogAgentModel", base="CogAgentModel", version="chat",
                     pretrained="cogagent-chat",
                     enable=["encoder", "cross_attention", "linear_proj", "mlp.vision", "rotary.vision", "eoi", "boi",
                             "vit"],
                     cross="get_image_processor(args.cross_image_pix)", merged_save='"checkpoints/merged_lora_cogagent"'),
}


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_fake_checkout(dest: str) -> str:
    """Write the synthetic checkout under ``dest`` (created if missing); returns ``dest``."""
    if os.path.exists(os.path.join(dest, "finetune_demo")) or os.path.exists(os.path.join(dest, "utils")):
        raise FileExistsError(f"{dest} already holds a checkout (finetune_demo/ or utils/): choose an empty directory")
    _write(os.path.join(dest, "utils", "__init__.py"), "")
    _write(os.path.join(dest, "utils", "models", "__init__.py"), MODELS_INIT)
    _write(os.path.join(dest, "utils", "models", "mixin.py"), MIXIN_FILE)
    _write(os.path.join(dest, "utils", "utils", "__init__.py"), UTILS_INIT)
    for kind, spec in KINDS.items():
        _write(os.path.join(dest, "utils", "models", f"{kind}_model.py"),
               MODEL_FILE.format(kind={"cogvlm": "CogVLM", "cogagent": "CogAgent"}[kind], base=spec["base"]))
        _write(os.path.join(dest, "finetune_demo", f"finetune_{kind}_demo.py"),
               DEMO.format(kind=kind, **{k: v for k, v in spec.items() if k != "base"}))
    _write(os.path.join(dest, "README.md"), textwrap.dedent("""\
        Synthetic CogVLM checkout written by the test suite (tests/support/fake_checkout.py).
        """))
    return dest
