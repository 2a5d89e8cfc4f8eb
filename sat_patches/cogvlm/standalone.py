"""Standalone CogVLM / CogAgent LoRA fine-tuning on SAT: ``sat-patches finetune prepare|train|verify``.

Follows upstream's ``finetune_demo/finetune_cog{vlm,agent}_demo.py`` (options, data layout, loss, LoRA
placement) on the models of :mod:`sat_patches.cogvlm`. ``--probe FILE`` records the trained model's logits
on one validation batch; :func:`compare_with_probe` compares the merged MP=1 model's with them.
"""
from __future__ import annotations

import argparse
import os
from functools import partial

import torch
from sat import get_args
from sat.training import deepspeed_training  # its functions looked up at call time: patched or replaced

from ..checkpoints import safe_load
from ..core.kinds import KINDS, NAMES
from ..data.jsonl import DataError, check_data_path
from ..runtime.checks import check_finetune_args
from . import create_dataset_function, data_collator, llama2_tokenizer, model_class_for
from .evaluation import answer_every_sample, greedy_answer
from .trainer import add_lora, disable_untrainable_params, forward_step, model_inputs, processors


def demo_parser(kind: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kind", choices=NAMES, default=kind)
    p.add_argument("--max_length", type=int)
    p.add_argument("--ignore_pad_token_for_loss", action="store_false")
    p.add_argument("--version", type=str, default="base", help="prompt template: base, chat, vqa, chat_old")
    p.add_argument("--from_pretrained", type=str, default=KINDS[kind].released, help="pretrained checkpoint")
    p.add_argument("--local_tokenizer", type=str, default="lmsys/vicuna-7b-v1.5", help="tokenizer path")
    p.add_argument("--vit_checkpoint_activations", action="store_true")
    p.add_argument("--vit_checkpoint_skip_layers", type=int, default=None, metavar="N",
                   help="the EVA tower's last N layers not checkpointed (default: the same share of its layers as "
                        "--checkpoint-skip-layers leaves out of the language model's)")
    p.add_argument("--probe", default=None, help="after training, save logits on one validation batch here")
    p.add_argument("--evaluate", default=None, metavar="DIR",
                   help="after training, answer every validation sample and write predictions.jsonl and "
                        "summary.json into DIR (sat-patches evaluate)")
    p.add_argument("--evaluate-before", default=None, metavar="DIR",
                   help="before training, the same with the untrained model (the baseline), into DIR")
    p.add_argument("--evaluate-max-new-tokens", type=int, default=16, metavar="N",
                   help="longest answer --evaluate and --evaluate-before generate, in tokens")
    return model_class_for(kind).add_model_specific_args(p)


def train(argv) -> int:
    kind = demo_parser("cogvlm").parse_known_args(argv)[0].kind
    os.environ.setdefault("SAT_PATCHES_TRAINABLE", "lora")  # this trainer's default: the adapters only
    known, rest = demo_parser(kind).parse_known_args(argv)
    check_finetune_args(known)  # LoRA rank, layer range, QLoRA: refused before anything is built
    args = get_args(rest)
    args = argparse.Namespace(**vars(args), **vars(known))
    # an empty or broken data set stops here, before the model is built
    problems = [p for path in (args.train_data or []) + (args.valid_data or []) for p in check_data_path(path)]
    if problems:
        raise DataError("\n".join(problems))
    if args.use_qlora:
        args.device = "cpu"  # as upstream's demo does; sat_patches keeps the model on the compute device
    cls = model_class_for(kind)
    cls.disable_untrainable_params = disable_untrainable_params
    overwrite = {"model_parallel_size": args.model_parallel_size} if args.model_parallel_size != 1 else {}
    model, args = cls.from_pretrained(args.from_pretrained, args, overwrite_args=overwrite)
    if args.use_lora or args.use_qlora:
        add_lora(model, args)
    tokenizer = llama2_tokenizer(args.local_tokenizer, signal_type=args.version)
    image, text, cross = processors(args, tokenizer)
    if args.evaluate_before:
        answer_every_sample(model, args, args.valid_data[0], args.local_tokenizer, args.evaluate_before, args.version,
                            args.evaluate_max_new_tokens, label="evaluation before training")
    model = deepspeed_training.training_main(args, model_cls=model, forward_step_function=forward_step,
                          create_dataset_function=partial(create_dataset_function, image, text, cross),
                          collate_fn=partial(data_collator, cross_image_processor=cross))
    if args.probe:
        save_probe(model, args, image, text, cross)
    if args.evaluate:
        answer_every_sample(model, args, args.valid_data[0], args.local_tokenizer, args.evaluate, args.version,
                            args.evaluate_max_new_tokens)
    return 0


def probe_batch(args, image, text, cross):
    dataset = create_dataset_function(image, text, cross, args.valid_data[0], args)
    return data_collator([dataset[0]], cross_image_processor=cross)


@torch.no_grad()
def save_probe(model, args, image, text, cross):
    module = getattr(model, "module", model)
    module.eval()
    batch = probe_batch(args, image, text, cross)
    device = next(module.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model_inputs(batch).items()}
    logits = module(**inputs)[0].float().cpu()
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.probe)), exist_ok=True)
        tmp = args.probe + ".tmp"
        torch.save({"logits": logits, "label": batch["question_id"], "valid_data": args.valid_data[0]}, tmp)
        os.replace(tmp, args.probe)
        print(f"probe: logits of the trained MP={args.model_parallel_size} model saved to {args.probe}", flush=True)
    torch.distributed.barrier()


@torch.no_grad()
def compare_with_probe(kind: str, probe_file: str, merged: str, local_tokenizer: str, max_length: int = 80,
                       version: str = "base") -> dict:
    """The merged MP=1 checkpoint ``merged`` on the batch ``train --probe`` recorded: ``{"difference": max |logit
    difference|, "answer": its greedy answer, "label": the sample's id}``."""
    probe = safe_load.load(probe_file)
    model, args = model_class_for(kind).from_pretrained(merged, None)
    model.eval()
    args.max_length = max_length
    tokenizer = llama2_tokenizer(local_tokenizer, signal_type=version)
    image, text, cross = processors(args, tokenizer)
    args.valid_data = [probe["valid_data"]]
    batch = probe_batch(args, image, text, cross)
    logits = model(**model_inputs(batch))[0].float()
    return {"difference": (logits - probe["logits"]).abs().max().item(),
            "answer": greedy_answer(model, batch, tokenizer), "label": probe["label"]}
