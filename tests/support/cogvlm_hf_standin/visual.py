"""Stand-in for cogvlm-chat-hf's ``visual.py`` (written for sat_patches' tests): EVA2-CLIP under the released
parameter names (``patch_embedding``, ``transformer.layers.N.{attention,mlp,...}``, ``linear_proj``, ``boi``,
``eoi``), post-norm layers, the GLU projector into the language model's width."""
from argparse import Namespace

import torch
from torch import nn


class PatchEmbedding(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = nn.Conv2d(c.in_channels, c.hidden_size, c.patch_size, c.patch_size)
        self.cls_embedding = nn.Parameter(torch.zeros(1, c.hidden_size))
        self.position_embedding = nn.Embedding(c.num_positions, c.hidden_size)

    def forward(self, images):
        x = self.proj(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight.unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c.num_heads
        self.query_key_value = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.dense(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.attention = Attention(c)
        self.mlp = MLP(c)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x):
        x = x + self.input_layernorm(self.attention(x))
        return x + self.post_attention_layernorm(self.mlp(x))


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class GLU(nn.Module):
    def __init__(self, config, in_features):
        super().__init__()
        h, inner = config.hidden_size, config.intermediate_size
        self.linear_proj = nn.Linear(in_features, h, bias=False)
        self.norm1 = nn.LayerNorm(h)
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.dense_h_to_4h = nn.Linear(h, inner, bias=False)
        self.dense_4h_to_h = nn.Linear(inner, h, bias=False)

    def forward(self, x):
        x = nn.functional.gelu(self.norm1(self.linear_proj(x)))
        return self.dense_4h_to_h(nn.functional.silu(self.gate_proj(x)) * self.dense_h_to_4h(x))


class EVA2CLIPModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        vision = Namespace(**config.vision_config)
        self.patch_embedding = PatchEmbedding(vision)
        self.transformer = Transformer(vision)
        self.linear_proj = GLU(config, vision.hidden_size)
        self.boi = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.eoi = nn.Parameter(torch.zeros(1, 1, config.hidden_size))

    def forward(self, images):
        x = self.linear_proj(self.transformer(self.patch_embedding(images))[:, 1:])
        return torch.cat([self.boi.expand(len(x), 1, -1), x, self.eoi.expand(len(x), 1, -1)], dim=1)
