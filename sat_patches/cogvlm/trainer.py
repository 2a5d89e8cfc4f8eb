"""Training CogVLM / CogAgent on SAT as upstream's finetune demos do: the batch (broadcast over the model-parallel
group), the loss on the answer tokens, what trains beside LoRA, the processors and LoRA placement. Used by
``python -m sat_patches finetune``, by evaluation and by a fork's demo through the test suite's stand-in checkout.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from sat import mpu
from sat.model.finetune.lora2 import LoraMixin

from ..checkpoints.lora_names import is_adapter
from ..core.kinds import KINDS
from . import get_image_processor, llama2_text_processor


def broadcast_batch(batch):
    """Tensors of the batch from model-parallel rank 0 to its group, one broadcast per dtype."""
    by_dtype, other = defaultdict(list), {}
    for key, value in (batch or {}).items():
        (by_dtype[value.dtype].append(key) if isinstance(value, torch.Tensor) else other.__setitem__(key, value))
    # every rank of the group must call with the same keys: take them from rank 0's batch
    box = [(dict(by_dtype), other)]
    group = mpu.get_model_parallel_group()
    torch.distributed.broadcast_object_list(box, src=mpu.get_model_parallel_src_rank(), group=group)
    by_dtype, other = box[0]
    out = dict(other)
    for dtype, keys in by_dtype.items():
        out.update(mpu.broadcast_data(keys, batch, dtype))
    return out


def get_batch(data_iterator, args, timers):
    timers("data loader").start()
    batch = next(data_iterator) if data_iterator is not None else None
    timers("data loader").stop()
    batch = broadcast_batch(batch)
    dtype = torch.half if args.fp16 else torch.bfloat16 if args.bf16 else None
    for key, value in batch.items():
        if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            batch[key] = value.to(dtype)
    return batch


def lm_loss(model, batch):
    labels = batch.pop("labels")
    logits = model(**batch)[0].float()
    shift_labels = labels[..., 1:].contiguous()
    shift_logits = logits[..., -1 - shift_labels.size(-1):-1, :].contiguous()
    return torch.nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                                             ignore_index=-100)


def model_inputs(batch):
    """What the model's forward takes: the batch without labels and bookkeeping fields."""
    return {k: v for k, v in batch.items() if k not in ("labels", "question_id", "context_length", "image_position")}


def forward_step(data_iterator, model, args, timers):
    timers("batch generator").start()
    batch = get_batch(data_iterator, args, timers)
    timers("batch generator").stop()
    loss = lm_loss(model, {**model_inputs(batch), "labels": batch["labels"]})
    return loss, {"loss": loss}


def disable_untrainable_params(model):
    """What upstream's demo trains: the adapters and the kind's ``demo_trains`` (:mod:`sat_patches.core.kinds`). ``SAT_PATCHES_TRAINABLE=lora``
    (the finetune scripts' default for this trainer) narrows it to the adapters."""
    kind = getattr(model.args, "kind", "cogvlm")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or KINDS[kind].demo_trains(name.lower()))


def processors(args, tokenizer):
    image = get_image_processor(args.eva_args["image_size"][0])
    cross = get_image_processor(args.cross_image_pix) if hasattr(args, "cross_image_pix") else None
    text = llama2_text_processor(tokenizer, args.max_length, args.image_length)
    return image, text, cross


def add_lora(model, args):
    """As upstream's demo: LoRA on the language model and on EVA; with ``--use_qlora`` the language
    model's linears become NF4 under LoRA, and EVA stays as it is."""
    model.add_mixin("lora", LoraMixin(args.num_layers, args.lora_rank, layer_range=args.layer_range,
                                      qlora=args.use_qlora), reinit=True)
    if args.use_qlora:
        return
    eva = model.get_mixin("eva").vit_model
    eva.add_mixin("lora", LoraMixin(args.eva_args["num_layers"], args.lora_rank, layer_range=args.layer_range),
                  reinit=True)


