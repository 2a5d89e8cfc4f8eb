"""What a training step of CogVLM / CogAgent keeps alive, measured on the real model at full size on meta.

The model is this project's checkpoint-compatible CogVLM/CogAgent (``sat_patches.cogvlm``) built at
full width on meta (:mod:`sat_patches.cogvlm.on_meta`) with as many layers of each kind as asked, LoRA added as the
fine-tuning demo adds it, the base frozen; one micro-batch at the demo's ``max_length`` and real image
sizes runs forward, loss and backward under :class:`.live_bytes.LiveBytes`, with the masks and positions
carrying their values (:class:`.meta_values.MetaValues`). A model-parallel rank is measured as rank 0 of
``mp`` without a process group (SAT's collectives stood in by their output shapes).

One layer of a kind costs the difference between two models that differ by one layer of that kind:
:func:`layer_bytes`. Seconds per model on a CPU, no memory.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Dict, Optional
from unittest import mock

import torch

KINDS = ("language", "eva", "encoder")
"""Layer kinds: the language model's (vision experts, and CogAgent's cross attention), the EVA2-CLIP-E
tower's, CogAgent's EVA2-CLIP-L cross encoder's."""
PLAN_TERMS = {"language": "activations (language)", "eva": "activations (EVA)", "encoder": "activations (cross branch)"}
"""The ``sat-patches plan`` activation term each kind of layer is counted in."""


def released_layers(config: dict) -> Dict[str, int]:
    """How many layers of each kind the model of ``config`` has (CogAgent's encoder: the code's default)."""
    from sat_patches.planning.shapes import plan_config
    c = plan_config(config)
    return {"language": c["num_layers"], "eva": c["eva_args"]["num_layers"],
            "encoder": c.get("encoder_args", {}).get("layers", 1)}


def _with_layers(config: dict, layers: Optional[Dict[str, int]]) -> dict:
    """``config`` (as the plan reads it) with ``layers`` of each kind, one of a kind not named."""
    counts = {kind: 1 for kind in KINDS}
    counts.update(layers or {})
    config = dict(config, num_layers=counts["language"])
    config["eva_args"] = dict(config["eva_args"], num_layers=counts["eva"])
    if config.get("cross_image_pix"):
        config["encoder_args"] = dict(config["encoder_args"], layers=counts["encoder"])
        config["is_decoder"] = [True] * counts["language"]
    return config


@contextlib.contextmanager
def fused_attention():
    """``scaled_dot_product_attention`` as the fused kernels that run it on a GPU (flash, memory-efficient)
    and on a CPU: on meta, torch would pick its math fallback, which materialises the score matrix those
    kernels never hold. Here it is the CPU flash kernel's operator, whose meta kernel allocates what they
    keep: the output and one fp32 log-sum-exp per head and token."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if query.device.type != "meta" or attn_mask is not None or kwargs:
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kwargs)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, scale=scale)[0]
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fused):
        yield


def _inputs(values, config: dict, tokens: int, batch: int) -> dict:
    """One micro-batch as the data pipeline makes it: [bos, boi, image..., eoi, text...], the image slots
    sharing one rotary position, a causal mask; pixels for EVA (and the cross encoder)."""
    image = config["image_length"]
    vision_expert = torch.zeros(batch, tokens, dtype=torch.long)
    vision_expert[:, 1:image + 2] = 1                          # boi + image
    image_embed = torch.zeros(batch, tokens, dtype=torch.long)
    image_embed[:, 1:image + 3] = 1                            # boi + image + eoi
    positions = torch.cat([torch.arange(2), torch.full((image,), 2), torch.arange(3, tokens - image + 1)])
    size = config["eva_args"]["image_size"][0]

    def image_inputs(pixels: int) -> dict:
        return {"image": torch.empty(batch, 3, pixels, pixels, dtype=torch.bfloat16, device="meta"),
                "input_ids": values.meta(torch.zeros(batch, 1, dtype=torch.long)), "position_ids": None,
                "attention_mask": values.meta(torch.ones(batch, 1, dtype=torch.long))}

    out = {"input_ids": values.meta(torch.zeros(batch, tokens, dtype=torch.long)),
           "position_ids": values.meta(positions.expand(batch, -1).contiguous()),
           "attention_mask": values.meta(torch.ones(batch, 1, tokens, tokens, dtype=torch.long).tril()),
           "vision_expert_mask": values.meta(vision_expert), "image_embed_mask": values.meta(image_embed),
           **{f"vision_{k}": v for k, v in image_inputs(size).items()}}
    if config.get("cross_image_pix"):
        out.update({f"cross_{k}": v for k, v in image_inputs(config["cross_image_pix"]).items()})
    return out


def step_peak(config: dict, mp: int = 1, *, layers: Optional[Dict[str, int]] = None, checkpoint: bool = False,
              tokens: Optional[int] = None, batch: int = 1, lora_rank: int = 10,
              trains: Callable[[str], bool] = lambda name: False, remember_outputs: bool = True,
              selective: float = 0.0) -> int:
    """Peak bytes alive during one LoRA training step (forward, loss, backward) of ``config`` (a released
    ``model_config.json``, e.g. ``sat_patches.cogvlm.shapes.upstream_config(name)``) as model-parallel rank 0
    of ``mp``, in bf16, with ``layers`` of each kind (default 1), activation checkpointing as
    ``--checkpoint-activations --vit_checkpoint_activations`` turn it on, at ``tokens`` (the demo's
    max_length by default); besides the LoRA factors, the parameters whose names ``trains`` accepts train
    (``sat_patches.core.kinds.KINDS[kind].demo_trains``: what upstream's demo trains). Weights and inputs made before the
    step are not counted, nor are the parameters' gradients (dropped as soon as each is complete).
    ``remember_outputs=False``: every meta kernel runs (:class:`.meta_values.MetaValues`). ``selective``: the share
    of checkpointed layers that checkpoint selectively (``SAT_PATCHES_CHECKPOINT_SELECTIVE``)."""
    from sat.model.finetune.lora2 import LoraMixin
    from sat_patches.runtime import devices
    from sat_patches.planning.shapes import default_seq_len, plan_config
    from sat_patches.cogvlm.on_meta import build_on_meta, model_parallel_as
    from collective_shapes import collectives_as_shapes
    from live_bytes import LiveBytes
    from meta_values import MetaValues
    config = _with_layers(plan_config(config), layers)
    tokens = tokens or default_seq_len(config)
    with devices.use_device("meta"), model_parallel_as(mp), collectives_as_shapes(mp), fused_attention(), \
            mock.patch.dict(os.environ, {"SAT_PATCHES_CHECKPOINT_SELECTIVE": str(selective)}):
        model = build_on_meta(config, mp)
        model.add_mixin("lora", LoraMixin(config["num_layers"], lora_rank), reinit=True)
        eva = model.get_mixin("eva").vit_model
        eva.add_mixin("lora", LoraMixin(config["eva_args"]["num_layers"], lora_rank), reinit=True)
        for name, p in model.named_parameters():
            p.requires_grad_("matrix_" in name or trains(name))
            if p.requires_grad:  # gradients are the plan's own term (and ZeRO moves them into its buckets)
                p.register_post_accumulate_grad_hook(_drop_grad)
        model.train()
        for transformer in (model.transformer, eva.transformer):
            transformer.checkpoint_activations = checkpoint
        with MetaValues(remember_outputs) as values:
            inputs = _inputs(values, config, tokens, batch)
            labels = values.meta(torch.zeros(batch, tokens, dtype=torch.long))
            with LiveBytes() as counter:
                logits = model(**inputs)[0].float()
                shift = logits[..., :-1, :].contiguous()
                loss = torch.nn.functional.cross_entropy(shift.view(-1, shift.size(-1)), labels[..., 1:].reshape(-1))
                loss.backward()
    return counter.peak


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def layer_bytes(config: dict, kind: str, mp: int = 1, **options) -> int:
    """What one more layer of ``kind`` (:data:`KINDS`) adds to the step's peak: the peak with three such
    layers less the peak with two (``options`` as :func:`step_peak`). Not two less one: from the second
    layer on, backward sums the gradients that several layers send to one shared input (CogAgent's
    encoder output) in a buffer of its own, once."""
    three, two = (step_peak(config, mp, layers={kind: n}, **options) for n in (3, 2))
    return three - two


def planned_activations(config: dict, mp: int = 1, *, layers: Optional[Dict[str, int]] = None,
                        checkpoint: bool = False, train: str = "lora", selective: float = 0.0) -> Dict[str, float]:
    """The plan's activation terms (``sat-patches plan``: micro-batch 1, the demo's max_length, LoRA rank 10)
    for the model :func:`step_peak` measures: ``config`` with ``layers`` of each kind; ``train`` as the plan's
    ``--train``; ``selective`` as the plan's share of selectively checkpointed layers."""
    import copy
    from sat_patches.planning import memory, shapes
    c = _with_layers(copy.deepcopy(shapes.plan_config(config)), layers)
    setup = memory.Setup(mp=mp, micro_batch=1, seq_len=shapes.default_seq_len(c), checkpoint_activations=checkpoint,
                         train=train, selective_share=selective)
    return {term: value for term, value in memory.estimate(c, setup).device.items()
            if term.startswith(("activations", "logits"))}


def planned_layer_bytes(config: dict, kind: str, mp: int = 1, **options) -> float:
    """The plan's counterpart of :func:`layer_bytes`: what one more layer of ``kind`` adds to its term
    (``options`` as :func:`planned_activations`)."""
    three, two = (planned_activations(config, mp, layers={kind: n}, **options)[PLAN_TERMS[kind]] for n in (3, 2))
    return three - two
