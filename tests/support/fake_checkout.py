"""A synthetic CogVLM checkout for tests: upstream's layout and entry points, our own short code.

``write_fake_checkout(dest)`` writes, under ``dest``::

    finetune_demo/finetune_cogvlm_demo.py     upstream's options and flow: FineTuneTrainCogVLMModel
    finetune_demo/finetune_cogagent_demo.py   from utils.models, LoRA on the language model and on
                                              EVA, training_main(...), then the LoRA merged and the
                                              model saved to checkpoints/merged_lora_cog{vlm<px>,agent}
    utils/models/__init__.py                  CogVLMModel, FineTuneTrainCogVLMModel, CogAgentModel,
    utils/models/cogvlm_model.py              FineTuneTrainCogAgentModel
    utils/models/cogagent_model.py
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

MODEL_FILE = '''\
"""{kind} as SAT models (synthetic checkout: the layers come from sat_patches.cogvlm)."""
from sat_patches.cogvlm import models as _impl

EVA_OUTPUT_WIDTH = 1792  # fixed in upstream's ImageMixin (self.in_features = 1792)


def _check_eva_width(args):
    width = args.eva_args.get("hidden_size")
    if width != EVA_OUTPUT_WIDTH:
        raise ValueError(f"eva_args.hidden_size is {{width}}, but the image projector takes {{EVA_OUTPUT_WIDTH}} "
                         f"features: keep eva_args.hidden_size {{EVA_OUTPUT_WIDTH}}")


class {base}(_impl.{base}):
    def __init__(self, args, transformer=None, **kwargs):
        _check_eva_width(args)
        super().__init__(args, transformer=transformer, **kwargs)


class FineTuneTrain{base}(_impl.FineTuneTrain{base}):
    def __init__(self, args, transformer=None, **kwargs):
        _check_eva_width(args)
        super().__init__(args, transformer=transformer, **kwargs)
'''

UTILS_INIT = '''\
from sat_patches.cogvlm import llama2_tokenizer, llama2_text_processor, get_image_processor, ItemDataset
'''

DEMO = '''\
"""Synthetic stand-in for CogVLM's finetune_demo/finetune_{kind}_demo.py (written by sat_patches.testing)."""
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
