"""A tiny CogVideoX-shaped SAT model and its ``training_main`` script for CPU ranks.

The names, the state-dict layout and the constructor keywords of THUDM/CogVideo v1.0's ``sat/``:
``DiffusionTransformer(transformer_args=..., num_layers=..., hidden_size=..., modules={...}, dtype="bf16")`` (its
dtype told by keyword, LoRA added by ``modules["lora_config"]`` with ``add_mixin("lora", ..., reinit=True)``), inside
an engine laid out as ``SATVideoDiffusionEngine``: the DiT at ``model.diffusion_model``, T5 at ``conditioner`` and
the 3D VAE at ``first_stage_model`` (small frozen stand-ins here), ``not_trainable_prefixes: ['all']`` leaving only
LoRA's ``matrix_A``/``matrix_B`` to train. The engine reads ``args.model_config`` (the run's YAML ``model:``).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import math
import os
import sys

import torch
import yaml
from torch import nn
from sat import get_args
from sat.model.base_model import BaseMixin, BaseModel
from sat.training import deepspeed_training  # its functions looked up at call time: patched or replaced

STR_TO_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LATENT_CHANNELS, TEXT_WIDTH, TEXT_TOKENS, VIDEO_TOKENS, VOCAB = 4, 16, 3, 8, 50


def network_config(num_layers=2, hidden_size=32, heads=4, r=4, lora_alpha=None):
    """The YAML's ``model.network_config`` of the tiny DiT (CogVideoX's ``configs/cogvideox_2b_lora.yaml`` shape)."""
    lora = {"target": "sat.model.finetune.lora2.LoraMixin", "params": {"r": r}}
    if lora_alpha is not None:
        lora["params"]["lora_alpha"] = lora_alpha
    return {"target": "tiny_cogvideo.TinyDiffusionTransformer", "params": {
        "num_layers": num_layers, "hidden_size": hidden_size, "num_attention_heads": heads,
        "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, "time_embed_dim": hidden_size,
        "transformer_args": {"vocab_size": 1, "max_sequence_length": 64, "layernorm_order": "pre",
                             "skip_init": False, "model_parallel_size": 1, "is_decoder": False},
        "modules": {"pos_embed_config": {"target": "tiny_cogvideo.PositionEmbeddingMixin"},
                    "patch_embed_config": {"target": "tiny_cogvideo.PatchEmbeddingMixin",
                                           "params": {"text_hidden_size": TEXT_WIDTH}},
                    "final_layer_config": {"target": "tiny_cogvideo.FinalLayerMixin"},
                    "lora_config": lora}}}


def model_config(lora=True):
    """The YAML's ``model:`` (what the engine reads as ``args.model_config``), with or without the LoRA."""
    network = network_config()
    if not lora:
        del network["params"]["modules"]["lora_config"]
    return {"network_config": network, "not_trainable_prefixes": ["all"]}


def dit(dtype):
    """The DiT alone, as the engine builds it: told its dtype ("bf16", "fp16", "fp32") by keyword."""
    network = copy.deepcopy(network_config())
    network["params"]["dtype"] = dtype
    return instantiate(network)


def engine(config, bf16=False):
    """The engine built outside ``training_main`` (the released base is written from one)."""
    return TinyVideoEngine(argparse.Namespace(fp16=False, bf16=bf16, model_config=config))


def instantiate(config, **extra):
    """``sgm.util.instantiate_from_config``: ``target`` built with ``params`` and ``extra``."""
    module, _, name = config["target"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**config.get("params", {}), **extra)


class PatchEmbeddingMixin(BaseMixin):
    """ImagePatchEmbeddingMixin's role: latent tokens and the text encoder's outputs projected to the width."""

    def __init__(self, in_channels, hidden_size, text_hidden_size):
        super().__init__()
        self.proj = nn.Linear(in_channels, hidden_size)
        self.text_proj = nn.Linear(text_hidden_size, hidden_size)

    def word_embedding_forward(self, input_ids, **kwargs):
        return torch.cat((self.text_proj(kwargs["encoder_outputs"]), self.proj(kwargs["images"])), dim=1)

    def reinit(self, parent_model=None):
        del self.transformer.word_embeddings


class PositionEmbeddingMixin(BaseMixin):
    """Basic3DPositionEmbeddingMixin's: a fixed (not trained) table."""

    def __init__(self, length, hidden_size):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.zeros(1, length, hidden_size), requires_grad=False)

    def position_embedding_forward(self, position_ids, **kwargs):
        return self.pos_embedding[:, :kwargs["text_length"] + kwargs["images"].shape[1]]

    def reinit(self, parent_model=None):
        del self.transformer.position_embeddings
        steps = torch.arange(self.pos_embedding.shape[1], dtype=torch.float32)[:, None]
        self.pos_embedding.data.copy_(torch.sin(steps / (1 + torch.arange(self.pos_embedding.shape[2]))))


class FinalLayerMixin(BaseMixin):
    """FinalLayerMixin's: the video tokens, modulated by the time embedding, to latent channels."""

    def __init__(self, hidden_size, time_embed_dim, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(time_embed_dim, hidden_size))

    def final_forward(self, logits, **kwargs):
        x = logits[:, kwargs["text_length"]:]
        return self.linear(self.norm_final(x) * (1 + self.adaLN_modulation(kwargs["emb"])[:, None]))


class TinyDiffusionTransformer(BaseModel):
    """DiffusionTransformer's constructor keywords and layout at tiny size."""

    def __init__(self, transformer_args, num_layers, hidden_size, num_attention_heads, in_channels, out_channels,
                 time_embed_dim=None, modules={}, **kwargs):  # noqa: B006 (upstream's signature)
        self.dtype = STR_TO_DTYPE[kwargs.pop("dtype", "fp32")]
        self.hidden_size, self.num_layers = hidden_size, num_layers
        self.time_embed_dim = time_embed_dim or hidden_size
        transformer_args = argparse.Namespace(**transformer_args) if isinstance(transformer_args, dict) \
            else transformer_args
        transformer_args.num_layers, transformer_args.hidden_size = num_layers, hidden_size
        transformer_args.num_attention_heads = num_attention_heads
        super().__init__(args=transformer_args, transformer=None, **kwargs)
        self.time_embed = nn.Sequential(nn.Linear(hidden_size, self.time_embed_dim), nn.SiLU(),
                                        nn.Linear(self.time_embed_dim, self.time_embed_dim))
        self.add_mixin("pos_embed", instantiate(modules["pos_embed_config"], length=TEXT_TOKENS + VIDEO_TOKENS,
                                                hidden_size=hidden_size), reinit=True)
        self.add_mixin("patch_embed", instantiate(modules["patch_embed_config"], in_channels=in_channels,
                                                  hidden_size=hidden_size), reinit=True)
        self.add_mixin("final_layer", instantiate(modules["final_layer_config"], hidden_size=hidden_size,
                                                  time_embed_dim=self.time_embed_dim, out_channels=out_channels),
                       reinit=True)
        if "lora_config" in modules:
            self.add_mixin("lora", instantiate(modules["lora_config"], layer_num=num_layers), reinit=True)

    def forward(self, x, timesteps=None, context=None, **kwargs):
        x = x.to(self.dtype)
        half = self.hidden_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=x.device) / half)
        angles = timesteps.float()[:, None] * freqs[None]
        emb = self.time_embed(torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(self.dtype))
        ones = torch.ones((1, 1), dtype=x.dtype, device=x.device)
        return super().forward(input_ids=ones, position_ids=ones, attention_mask=ones, images=x, emb=emb,
                               encoder_outputs=context.to(self.dtype), text_length=context.shape[1])[0]


class DiffusionWrapper(nn.Module):
    """``OPENAIUNETWRAPPER``'s place: the DiT at ``model.diffusion_model``."""

    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model


class TinyVideoEngine(nn.Module):
    """SATVideoDiffusionEngine's layout: the DiT told its dtype as a name, T5 and the VAE frozen beside it."""

    def __init__(self, args, **kwargs):
        super().__init__()
        dtype = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
        network = copy.deepcopy(args.model_config["network_config"])
        network["params"]["dtype"] = dtype
        self.model = DiffusionWrapper(instantiate(network))
        self.conditioner = nn.Embedding(VOCAB, TEXT_WIDTH)              # T5's stand-in
        self.first_stage_model = nn.Linear(LATENT_CHANNELS, LATENT_CHANNELS)  # the 3D VAE's stand-in
        for frozen in (self.conditioner, self.first_stage_model):
            frozen.requires_grad_(False)
        self.not_trainable_prefixes = args.model_config.get("not_trainable_prefixes", ["all"])

    def disable_untrainable_params(self):
        for name, p in self.named_parameters():
            frozen = any(name.startswith(prefix) or prefix == "all" for prefix in self.not_trainable_prefixes)
            if frozen and "matrix_A" not in name and "matrix_B" not in name:
                p.requires_grad_(False)

    def reinit(self, parent_model=None):  # load_checkpoint calls it for keys a checkpoint lacks (T5's, the VAE's)
        pass

    def forward(self, video, txt):
        with torch.no_grad():
            latents = self.first_stage_model(video.to(self.first_stage_model.weight.dtype))
            context = self.conditioner(txt)
        g = torch.Generator().manual_seed(int(txt.sum()))
        timesteps = torch.randint(0, 1000, (video.shape[0],), generator=g)
        noise = torch.randn(latents.shape, generator=g).to(latents)
        predicted = self.model.diffusion_model(latents + noise, timesteps, context)
        return torch.nn.functional.mse_loss(predicted.float(), noise.float())


class VideoSamples(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.video = torch.randn(n, VIDEO_TOKENS, LATENT_CHANNELS, generator=g)
        self.txt = torch.randint(0, VOCAB, (n, TEXT_TOKENS), generator=g)

    def __len__(self):
        return len(self.txt)

    def __getitem__(self, i):
        return {"mp4": self.video[i], "txt": self.txt[i]}


def create_dataset(path, args):
    return VideoSamples()


def to_plain(config):
    """An OmegaConf config (the real engine's) as plain dicts and lists; anything else as it is."""
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        return OmegaConf.to_container(config)
    return config


def write_config(args):
    """``training_config.yaml`` into the run's folder, as ``train_video.py``'s forward step writes it."""
    config = os.path.join(args.save or "", "training_config.yaml")
    if args.save and torch.distributed.get_rank() == 0 and not os.path.exists(config):
        os.makedirs(args.save, exist_ok=True)
        with open(config, "w") as f:
            yaml.safe_dump({"model": to_plain(args.model_config)}, f)


def forward_step(data_iterator, model, args, timers):
    batch = next(data_iterator)
    write_config(args)
    loss = model(batch["mp4"].to(args.device), batch["txt"].to(args.device))
    return loss, {}


ARGS = ["--mode", "finetune", "--train-iters", "2", "--batch-size", "2", "--lr", "0.05",
        "--lr-decay-style", "constant", "--log-interval", "1", "--train-data", "synthetic", "--split", "1",
        "--seed", "1234", "--save-interval", "100000", "--eval-interval", "100000", "--num-workers", "0",
        "--experiment-name", "tiny-video", "--no-load-rng", "--force-train"]


def main(argv, config, engine_class=TinyVideoEngine, step=forward_step, dataset=create_dataset):
    """``train_video.py``'s ``training_main`` call: ``argv`` its arguments (``--load``, ``--save`` ...),
    ``config`` the YAML's ``model:``. Returns the trained engine."""
    args = get_args(ARGS + list(argv), argparse.ArgumentParser(description="tiny video"))
    args.model_config = config
    return deepspeed_training.training_main(args, model_cls=engine_class, forward_step_function=step,
                                            create_dataset_function=dataset)


if __name__ == "__main__":
    main(sys.argv[1:], model_config())
