"""CogVLM steps for checking the fast paths against the plain ones: a batch in CogVLM's layout, one training
step's logits and gradients, how often a step waits for the device, and CogVLM's own boolean-mask routing put back
in place of :mod:`sat_patches.cogvlm.routing` (the reference, and what the benchmarks call stock)."""
from __future__ import annotations

import contextlib

import torch
from sat.model.base_model import get_model

from sat_patches.cogvlm import model_class_for, tiny_args, vision_expert


def route_by_mask(x: torch.Tensor, mask: torch.Tensor, language, vision) -> torch.Tensor:
    """The boolean-mask routing of CogVLM's own code, kept as the reference the fast paths are checked against."""
    mask = mask.bool()
    lang = language(x[~mask])
    out = lang.new_empty(*x.shape[:-1], lang.shape[-1])
    out[~mask] = lang
    out[mask] = vision(x[mask]).to(lang.dtype)
    return out


def build_cogvlm(checkpointing: bool, seed: int = 0, device="cpu", dtype=torch.float32, kind: str = "cogvlm",
                 **overrides):
    """CogVLM (or ``kind``) in training mode, tiny unless ``overrides`` give other sizes."""
    args = tiny_args(kind, checkpoint_activations=checkpointing, **overrides)
    torch.manual_seed(seed)
    model = get_model(args, model_class_for(kind)).to(device=device, dtype=dtype)
    model.train()
    return model, args


def add_lora(model, rank: int = 2) -> None:
    """SAT's ``LoraMixin`` on the language model and EVA (as upstream's demo); only the LoRA factors train."""
    from sat.model.finetune.lora2 import LoraMixin
    torch.manual_seed(1)
    model.add_mixin("lora", LoraMixin(len(model.transformer.layers), rank), reinit=True)
    vit = model.get_mixin("eva").vit_model
    vit.add_mixin("lora", LoraMixin(len(vit.transformer.layers), rank), reinit=True)
    for name, p in model.named_parameters():
        p.requires_grad_("matrix_" in name)
        if "matrix_B" in name:  # (LoRA starts B at zero: no gradient reaches A, nothing to compare)
            with torch.no_grad():
                p.normal_(0, 0.1)


def checkpointing(model, on: bool) -> None:
    """``--checkpoint-activations --vit_checkpoint_activations`` (``on=False``: neither)."""
    model.transformer.checkpoint_activations = on
    model.get_mixin("eva").vit_model.transformer.checkpoint_activations = on


def cogvlm_batch(args, batch: int = 2, seed: int = 0, device="cpu", dtype=torch.float32) -> dict:
    """Random tokens and images laid out as CogVLM's text processor lays them: BOS, boi, the patches, eoi, text."""
    g = torch.Generator().manual_seed(seed)
    n, image = args.max_length, args.image_length
    vision_expert_mask = torch.zeros(batch, n, dtype=torch.long)
    vision_expert_mask[:, 1:image + 2] = 1        # boi and the patches go through the vision expert
    image_embed_mask = torch.zeros(batch, n, dtype=torch.long)
    image_embed_mask[:, 1:image + 3] = 1          # boi, the patches, eoi take the image's embeddings
    size = args.eva_args["image_size"][0]
    inputs = dict(input_ids=torch.randint(3, args.vocab_size, (batch, n), generator=g),
                  position_ids=torch.arange(n).repeat(batch, 1),
                  attention_mask=torch.ones(n, n).tril()[None, None].repeat(batch, 1, 1, 1),
                  vision_expert_mask=vision_expert_mask, image_embed_mask=image_embed_mask,
                  vision_image=torch.randn(batch, 3, size, size, generator=g),
                  vision_input_ids=torch.zeros(batch, 1, dtype=torch.long), vision_position_ids=None,
                  vision_attention_mask=torch.ones(batch, 1, dtype=torch.long))
    if getattr(args, "cross_image_pix", None):  # CogAgent: the high-resolution image of its cross encoder
        pix = args.cross_image_pix
        inputs.update(cross_image=torch.randn(batch, 3, pix, pix, generator=g), cross_position_ids=None,
                      cross_input_ids=torch.zeros(batch, 1, dtype=torch.long),
                      cross_attention_mask=torch.ones(batch, 1, dtype=torch.long))
    return {k: None if v is None else v.to(device, dtype=dtype if v.is_floating_point() else v.dtype)
            for k, v in inputs.items()}


def train_step(model, batch: dict):
    """Forward, a loss on the logits, backward: the logits and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(**batch)[0]
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def host_reads(fn) -> int:
    """How often ``fn()`` reads a tensor into Python or counts a boolean index: each waits for the device on a GPU."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::_local_scalar_dense", 0) + counts.get("aten::nonzero", 0)


class _MaskRouting:
    def __init__(self, mask):
        self.mask = mask

    def apply(self, x, language, vision):
        return route_by_mask(x, self.mask, language, vision)


def _mask_routing_for(layer_id, layer_range, kw_args):
    mask = kw_args.get("vision_expert_mask")
    return None if layer_id not in layer_range or mask is None else _MaskRouting(mask)


@contextlib.contextmanager
def boolean_mask_routing():
    """Inside, CogVLM's experts route tokens with boolean masks in every layer, as CogVLM's own code does."""
    fast = vision_expert.routing_for
    vision_expert.routing_for = _mask_routing_for
    try:
        yield
    finally:
        vision_expert.routing_for = fast
