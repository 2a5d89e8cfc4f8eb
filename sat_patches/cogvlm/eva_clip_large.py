"""EVA2-CLIP-L high-resolution encoder of CogAgent's cross-attention branch (plain torch).

Mirrors CogVLM ``utils/models/eva_clip_L_hf.py`` and the ``ExternalVisionModel`` wrapper of
``utils/models/cogagent_model.py``, with upstream's module and parameter names. As upstream, the forward pass
skips the last block and returns the patch tokens. ``encoder_args`` may override the sizes upstream hard-codes
(:data:`EVA_CLIP_L_DEFAULTS`), so a tiny CogAgent can be built.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sat.model.base_model import BaseMixin

from .placement import Placement, make_module, zeros_parameter
from .shapes import EVA_CLIP_L_DEFAULTS


def encoder_config(encoder_args: Optional[dict]) -> dict:
    cfg = {**EVA_CLIP_L_DEFAULTS, **(encoder_args or {})}
    unknown = set(cfg) - set(EVA_CLIP_L_DEFAULTS)
    if unknown:
        raise ValueError(f"encoder_args: unknown keys {sorted(unknown)}; known: {sorted(EVA_CLIP_L_DEFAULTS)}")
    if cfg["width"] % cfg["head_width"]:
        raise ValueError(f"encoder_args: width {cfg['width']} is not a multiple of head_width {cfg['head_width']}")
    return cfg


class VisionRotary(nn.Module):
    """2-D rotary table over a ``grid x grid`` patch grid, frequencies interpolated from the
    pre-training grid ``pt_seq_len`` (upstream ``VisionRotaryEmbeddingFast`` with ``intp_freq``).
    Channels pair up as (even, odd); the first half of the head follows the row, the second the column."""

    def __init__(self, half_head_dim: int, pt_seq_len: int, grid: int, placement: Placement):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, half_head_dim, 2).float()[: half_head_dim // 2] / half_head_dim))
        t = torch.arange(grid).float() / grid * pt_seq_len
        freqs = torch.outer(t, inv_freq).repeat_interleave(2, dim=-1)          # (grid, half_head_dim)
        rows = freqs[:, None, :].expand(grid, grid, -1)
        cols = freqs[None, :, :].expand(grid, grid, -1)
        table = torch.cat([rows, cols], dim=-1).reshape(grid * grid, -1)       # (grid*grid, head_dim)
        self.register_buffer("freqs_cos", table.cos().to(**placement.factory))
        self.register_buffer("freqs_sin", table.sin().to(**placement.factory))

    def forward(self, x):
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return x * self.freqs_cos + rotated * self.freqs_sin


class SubLNAttention(nn.Module):
    """Separate q/k/v projections, q and v biases, LayerNorm on the context before ``proj``."""

    def __init__(self, dim, num_heads, rope: VisionRotary, placement: Placement, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = make_module(placement, nn.Linear, dim, dim, bias=False)
        self.k_proj = make_module(placement, nn.Linear, dim, dim, bias=False)
        self.v_proj = make_module(placement, nn.Linear, dim, dim, bias=False)
        self.q_bias = zeros_parameter(placement, dim)
        self.v_bias = zeros_parameter(placement, dim)
        self.inner_attn_ln = make_module(placement, nn.LayerNorm, dim, eps=eps)
        self.proj = make_module(placement, nn.Linear, dim, dim)
        self.rope = rope

    def forward(self, x):
        batch, tokens, _ = x.shape
        heads = lambda t: t.view(batch, tokens, self.num_heads, -1).transpose(1, 2)  # noqa: E731
        q = heads(F.linear(x, self.q_proj.weight, self.q_bias))
        k = heads(self.k_proj(x))
        v = heads(F.linear(x, self.v_proj.weight, self.v_bias))
        # rotary on the patch tokens only; token 0 is [CLS]
        q = torch.cat([q[:, :, :1], self.rope(q[:, :, 1:])], dim=2).type_as(v)
        k = torch.cat([k[:, :, :1], self.rope(k[:, :, 1:])], dim=2).type_as(v)
        context = F.scaled_dot_product_attention(q, k, v)
        context = context.transpose(1, 2).reshape(batch, tokens, -1)
        return self.proj(self.inner_attn_ln(context))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden, placement: Placement, eps: float):
        super().__init__()
        self.w1 = make_module(placement, nn.Linear, dim, hidden)
        self.w2 = make_module(placement, nn.Linear, dim, hidden)
        self.ffn_ln = make_module(placement, nn.LayerNorm, hidden, eps=eps)
        self.w3 = make_module(placement, nn.Linear, hidden, dim)

    def forward(self, x):
        return self.w3(self.ffn_ln(F.silu(self.w1(x)) * self.w2(x)))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``."""

    def __init__(self, dim, num_heads, mlp_hidden, rope, placement: Placement, eps: float):
        super().__init__()
        self.norm1 = make_module(placement, nn.LayerNorm, dim, eps=eps)
        self.attn = SubLNAttention(dim, num_heads, rope, placement, eps)
        self.norm2 = make_module(placement, nn.LayerNorm, dim, eps=eps)
        self.mlp = SwiGLU(dim, mlp_hidden, placement, eps)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class EvaVisionTower(nn.Module):
    """Upstream ``EVAVisionTransformer`` at CogAgent's settings."""

    def __init__(self, image_size: int, cfg: dict, placement: Placement):
        super().__init__()
        dim, patch = cfg["width"], cfg["patch_size"]
        if image_size % patch:
            raise ValueError(f"cross_image_pix {image_size} is not a multiple of the encoder patch size {patch}")
        grid = image_size // patch
        num_heads = dim // cfg["head_width"]
        eps = cfg["layernorm_epsilon"]
        self.image_size = image_size
        self.patch_embed = nn.ModuleDict({"proj": make_module(placement, nn.Conv2d, 3, dim, kernel_size=patch,
                                                              stride=patch)})
        self.cls_token = zeros_parameter(placement, 1, 1, dim)
        self.pos_embed = zeros_parameter(placement, 1, grid * grid + 1, dim)
        self.rope = VisionRotary(dim // num_heads // 2, cfg["pt_hw_seq_len"], grid, placement)
        mlp_hidden = int(dim * cfg["mlp_ratio"])
        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_hidden, self.rope, placement, eps)
                                     for _ in range(cfg["layers"])])
        self.norm = make_module(placement, nn.LayerNorm, dim, eps=eps)
        self.head = make_module(placement, nn.Linear, dim, cfg["embed_dim"])
        if placement.skip_init:
            return
        with torch.no_grad():
            for p in (self.pos_embed, self.cls_token):
                nn.init.trunc_normal_(p, std=0.02)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.trunc_normal_(m.weight, std=0.02)
                    if m.bias is not None:
                        m.bias.zero_()
            for depth, block in enumerate(self.blocks, start=1):  # upstream fix_init_weight
                block.attn.proj.weight.div_(math.sqrt(2.0 * depth))
                block.mlp.w3.weight.div_(math.sqrt(2.0 * depth))

    def forward(self, image):
        if image.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"cross image is {tuple(image.shape[-2:])}, the encoder was built for "
                             f"{self.image_size}x{self.image_size} (cross_image_pix)")
        proj = self.patch_embed["proj"]
        x = proj(image.to(proj.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks[:-1]:  # the last block is dropped, as upstream
            x = block(x)
        return x[:, 1:]


class EvaLargeEncoder(nn.Module):
    """Upstream ``Eva2LargeEncoder``: holds the tower as ``model``."""

    def __init__(self, image_size: int, cfg: dict, placement: Placement):
        super().__init__()
        self.model = EvaVisionTower(image_size, cfg, placement)

    def forward(self, images):
        return self.model(images)


class ExternalVisionModel(BaseMixin):
    """The ``encoder`` mixin of CogAgent: high-resolution encoder plus a learned position table
    ``pos_embed`` of ``(cross_image_pix // patch)**2 x width`` (upstream hard-codes 14 and 1024)."""

    def __init__(self, cross_image_pix: int, encoder_args: Optional[dict] = None, params_dtype=None,
                 device=None, skip_init=False):
        super().__init__()
        cfg = encoder_config(encoder_args)
        placement = Placement.resolve(params_dtype, device, skip_init)
        self.vit = EvaLargeEncoder(cross_image_pix, cfg, placement)
        self.pos_embed = zeros_parameter(placement, (cross_image_pix // cfg["patch_size"]) ** 2, cfg["width"])

    def forward(self, image=None, **unused):
        if image is None:
            raise ValueError("CogAgent's cross encoder needs the high-resolution image as cross_image")
        return self.vit(image) + self.pos_embed.unsqueeze(0)
