"""Tiny CogVLM training steps for the fast-path tests: a batch in CogVLM's layout, one step's logits and
gradients, its host reads, and CogVLM's own boolean-mask routing to compare with."""
import torch

from sat.model.base_model import get_model

from sat_patches.cogvlm import model_class_for, tiny_args
from sat_patches.cogvlm.routing import route_by_mask


def build(checkpointing, seed=0):
    args = tiny_args("cogvlm", checkpoint_activations=checkpointing)
    torch.manual_seed(seed)
    model = get_model(args, model_class_for("cogvlm"))
    model.train()
    return model, args


def batch_for(args, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, image = args.max_length, args.image_length
    input_ids = torch.randint(3, args.vocab_size, (batch, n), generator=g)
    vision_expert_mask = torch.zeros(batch, n, dtype=torch.long)
    vision_expert_mask[:, 1:image + 2] = 1        # boi and the patches (the text processor's layout)
    image_embed_mask = torch.zeros(batch, n, dtype=torch.long)
    image_embed_mask[:, 1:image + 3] = 1          # boi, the patches, eoi
    size = args.eva_args["image_size"][0]
    return dict(input_ids=input_ids, position_ids=torch.arange(n).repeat(batch, 1),
                attention_mask=torch.ones(n, n).tril()[None, None].repeat(batch, 1, 1, 1),
                vision_expert_mask=vision_expert_mask, image_embed_mask=image_embed_mask,
                vision_image=torch.randn(batch, 3, size, size, generator=g),
                vision_input_ids=torch.zeros(batch, 1, dtype=torch.long), vision_position_ids=None,
                vision_attention_mask=torch.ones(batch, 1, dtype=torch.long))


def step(model, batch):
    model.zero_grad(set_to_none=True)
    logits = model(**batch)[0]
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class MaskRouting:
    """CogVLM's own boolean-mask routing, put in place of the fast one."""

    def __init__(self, mask):
        self.mask = mask

    def apply(self, x, language, vision):
        return route_by_mask(x, self.mask, language, vision)


def mask_routing(layer_id, layer_range, kw_args):
    mask = kw_args.get("vision_expert_mask")
    return None if layer_id not in layer_range or mask is None else MaskRouting(mask)


def host_reads(model, batch):
    """Operations that wait for the device on a GPU: a tensor read into Python, a count for a boolean index."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(model, batch)
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::_local_scalar_dense", 0) + counts.get("aten::nonzero", 0)
