"""Stand-in for cogvlm-chat-hf's ``modeling_cogvlm.py`` (written for sat_patches' tests, not upstream's code):
``CogVLMForCausalLM`` with the released parameter names and call (``input_ids``, ``images`` as a list of
lists of [3, H, W] tensors, ``token_type_ids`` 1 at boi, the patches and eoi). Each language layer holds a
language and a vision expert (attention qkv/dense and gated MLP); a token takes the vision expert when it
and the next token are image tokens (boi and the patches; eoi is the language expert's). Rotary positions:
boi at p, every patch at p + 1, eoi at p + 2; each layer's ``self_attn.rotary_emb.inv_freq`` buffer is in the
state dict (as the export writes it). Loads through ``from_pretrained`` (``post_init``); ``generate`` works
greedily without a cache (every step runs the whole sequence, the new tokens language tokens)."""
import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_cogvlm import CogVLMConfig
from .visual import EVA2CLIPModel

VISION_TOKEN_TYPE = 1


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        y = x.float()
        return (self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def vision_expert_mask(token_type_ids):
    is_image = token_type_ids == VISION_TOKEN_TYPE
    mask = torch.zeros_like(is_image)
    mask[:, :-1] = is_image[:, :-1] & is_image[:, 1:]
    return mask.unsqueeze(-1)


def position_ids(token_type_ids):
    is_image = token_type_ids == VISION_TOKEN_TYPE
    patch = is_image.clone()
    patch[:, 1:] &= is_image[:, :-1]                    # an image token after another: not boi
    patch[:, :-1] &= is_image[:, 1:]                    # ... and before another: not eoi
    repeat = torch.zeros_like(patch)
    repeat[:, 1:] = patch[:, 1:] & patch[:, :-1]        # every patch after the first keeps its position
    return torch.cumsum(~repeat, dim=1) - 1


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))


def rotate(x, positions, inv_freq):
    half = x.shape[-1] // 2
    angles = positions[:, None, :, None].float() * inv_freq.float()
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(x.dtype), torch.cat([angles.sin()] * 2, -1).to(x.dtype)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class VisionExpertAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.heads = c.hidden_size, c.num_attention_heads
        self.vision_expert_query_key_value = nn.Linear(h, 3 * h, bias=False)
        self.vision_expert_dense = nn.Linear(h, h, bias=False)
        self.language_expert_query_key_value = nn.Linear(h, 3 * h, bias=False)
        self.language_expert_dense = nn.Linear(h, h, bias=False)
        self.rotary_emb = RotaryEmbedding(h // self.heads)

    def forward(self, x, vision, positions):
        b, n, h = x.shape
        qkv = torch.where(vision, self.vision_expert_query_key_value(x), self.language_expert_query_key_value(x))
        q, k, v = qkv.view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(rotate(q, positions, self.rotary_emb.inv_freq),
                                                         rotate(k, positions, self.rotary_emb.inv_freq), v,
                                                         is_causal=True)
        out = out.transpose(1, 2).reshape(b, n, h)
        return torch.where(vision, self.vision_expert_dense(out), self.language_expert_dense(out))


class VisionExpertMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.language_mlp, self.vision_mlp = MLP(c), MLP(c)

    def forward(self, x, vision):
        return torch.where(vision, self.vision_mlp(x), self.language_mlp(x))


class CogVLMDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = VisionExpertAttention(c), VisionExpertMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, hidden_states, token_type_ids, position_ids):
        vision = vision_expert_mask(token_type_ids)
        x = hidden_states + self.self_attn(self.input_layernorm(hidden_states), vision, position_ids)
        return (x + self.mlp(self.post_attention_layernorm(x), vision),)


class CogVLMPreTrainedModel(PreTrainedModel):
    config_class = CogVLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False


class CogVLMModel(CogVLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CogVLMDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.vision = EVA2CLIPModel(config)
        self.post_init()

    def forward(self, input_ids, images, token_type_ids):
        x = self.embed_tokens(input_ids)
        features = self.vision(torch.stack([image for sample in images for image in sample]))
        x = x.index_put([token_type_ids == VISION_TOKEN_TYPE], features.reshape(-1, x.shape[-1]).to(x.dtype))
        positions = position_ids(token_type_ids)
        for layer in self.layers:
            x = layer(x, token_type_ids=token_type_ids, position_ids=positions)[0]
        return self.norm(x)


class CogVLMForCausalLM(CogVLMPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = CogVLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def prepare_inputs_for_generation(self, input_ids, images=None, token_type_ids=None, **kwargs):
        grown = input_ids.shape[1] - token_type_ids.shape[1]       # the generated tokens: language tokens
        token_type_ids = nn.functional.pad(token_type_ids, (0, grown))
        return {"input_ids": input_ids, "images": images, "token_type_ids": token_type_ids, "use_cache": False}

    def forward(self, input_ids=None, images=None, token_type_ids=None, attention_mask=None, use_cache=None,
                **kwargs):
        return CausalLMOutputWithPast(logits=self.lm_head(self.model(input_ids, images, token_type_ids)))
