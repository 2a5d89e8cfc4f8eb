"""THUDM/CogVideo v1.0's own ``SATVideoDiffusionEngine`` and ``DiffusionTransformer`` (from the checkout's ``sat/``
folder that ``SAT_PATCHES_COGVIDEO_CHECKOUT`` names) at tiny size, with stand-ins for T5 and the 3D VAE, behind
:mod:`tiny_cogvideo`'s interface (``model_config``, ``engine``, ``main``). Needs CogVideo's requirements beside SAT
(omegaconf, pytorch_lightning, kornia)."""
from __future__ import annotations

import argparse
import copy
import os
import sys
import types

import torch
from torch import nn

CHECKOUT = os.environ.get("SAT_PATCHES_COGVIDEO_CHECKOUT", "")
if CHECKOUT and CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)

from omegaconf import OmegaConf  # noqa: E402
from diffusion_video import SATVideoDiffusionEngine  # noqa: E402
from sgm.modules.encoders.modules import AbstractEmbModel  # noqa: E402
from sgm.util import instantiate_from_config  # noqa: E402

import tiny_cogvideo  # noqa: E402

try:
    import torchvision  # noqa: F401
except ImportError:  # PyPI's torchvision does not load beside the CPU torch build; upstream's loss module imports
    # it only for LPIPS, which an l2 loss never builds (after pytorch_lightning, which looks for it)
    sys.modules["torchvision"] = types.ModuleType("torchvision")
    sys.modules["torchvision"].models = sys.modules["torchvision.models"] = types.ModuleType("torchvision.models")

TEXT_TOKENS, TEXT_WIDTH, LATENT_CHANNELS, FRAMES, PIXELS = 3, 16, 4, 5, 32
DISCRETIZATION = {"target": "sgm.modules.diffusionmodules.discretizer.ZeroSNRDDPMDiscretization",
                  "params": {"shift_scale": 3.0}}


class TextEncoder(AbstractEmbModel):
    """FrozenT5Embedder's place: each prompt's characters embedded, ``TEXT_TOKENS`` of them."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(128, TEXT_WIDTH)

    def forward(self, text):
        codes = [[ord(c) % 128 for c in (t + " " * TEXT_TOKENS)[:TEXT_TOKENS]] for t in text]
        return self.embedding(torch.tensor(codes, device=self.embedding.weight.device))


class VideoAutoencoder(nn.Module):
    """VideoAutoencoderInferenceWrapper's place: frames 1 + 4k to 1 + k, pixels 8 x 8 to one latent."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, LATENT_CHANNELS)

    def encode(self, x):  # (b, c, t, h, w)
        x = torch.cat([x[:, :, :1], x[:, :, 1:].unflatten(2, (-1, 4)).mean(3)], dim=2)
        x = torch.nn.functional.avg_pool3d(x.float(), (1, 8, 8)).to(x.dtype)
        return self.proj(x.movedim(1, -1)).movedim(-1, 1)


def model_config(lora=True):
    """``configs/cogvideox_2b_lora.yaml``'s ``model:`` at tiny size."""
    modules = {
        "pos_embed_config": {"target": "dit_video_concat.Basic3DPositionEmbeddingMixin",
                             "params": {"text_length": TEXT_TOKENS}},
        "patch_embed_config": {"target": "dit_video_concat.ImagePatchEmbeddingMixin",
                               "params": {"text_hidden_size": TEXT_WIDTH}},
        "adaln_layer_config": {"target": "dit_video_concat.AdaLNMixin", "params": {"qk_ln": True}},
        "final_layer_config": {"target": "dit_video_concat.FinalLayerMixin"},
    }
    if lora:
        modules["lora_config"] = {"target": "sat.model.finetune.lora2.LoraMixin", "params": {"r": 4}}
    network = {"target": "dit_video_concat.DiffusionTransformer", "params": {
        "time_embed_dim": 16, "elementwise_affine": True, "num_frames": FRAMES, "time_compressed_rate": 4,
        "latent_width": PIXELS // 8, "latent_height": PIXELS // 8, "num_layers": 2, "patch_size": 2,
        "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, "hidden_size": 32, "adm_in_channels": 8,
        "num_attention_heads": 4,
        "transformer_args": {"checkpoint_activations": False, "vocab_size": 1, "max_sequence_length": 64,
                             "layernorm_order": "pre", "skip_init": False, "model_parallel_size": 1,
                             "is_decoder": False},
        "modules": modules}}
    return {
        "scale_factor": 1.0, "disable_first_stage_autocast": True, "not_trainable_prefixes": ["all"],
        "log_keys": ["txt"],
        "denoiser_config": {"target": "sgm.modules.diffusionmodules.denoiser.DiscreteDenoiser", "params": {
            "num_idx": 1000, "quantize_c_noise": False,
            "weighting_config": {"target": "sgm.modules.diffusionmodules.denoiser_weighting.EpsWeighting"},
            "scaling_config": {"target": "sgm.modules.diffusionmodules.denoiser_scaling.VideoScaling"},
            "discretization_config": DISCRETIZATION}},
        "network_config": network,
        "conditioner_config": {"target": "sgm.modules.GeneralConditioner", "params": {"emb_models": [
            {"is_trainable": False, "input_key": "txt", "ucg_rate": 0.1, "target": "cogvideo_checkout.TextEncoder"}]}},
        "first_stage_config": {"target": "cogvideo_checkout.VideoAutoencoder"},
        "loss_fn_config": {"target": "sgm.modules.diffusionmodules.loss.VideoDiffusionLoss", "params": {
            "offset_noise_level": 0, "sigma_sampler_config": {
                "target": "sgm.modules.diffusionmodules.sigma_sampling.DiscreteSampling",
                "params": {"uniform_sampling": True, "num_idx": 1000, "discretization_config": DISCRETIZATION}}}},
    }


def dit(dtype):
    network = copy.deepcopy(model_config()["network_config"])
    network["params"]["dtype"] = dtype
    return instantiate_from_config(OmegaConf.create(network))


def engine(config, bf16=False):
    return SATVideoDiffusionEngine(argparse.Namespace(fp16=False, bf16=bf16, device="cpu",
                                                      model_config=OmegaConf.create(copy.deepcopy(config))))


class Videos(torch.utils.data.Dataset):
    def __init__(self, n=16):
        g = torch.Generator().manual_seed(0)
        self.video = torch.randn(n, FRAMES, 3, PIXELS, PIXELS, generator=g)

    def __len__(self):
        return len(self.video)

    def __getitem__(self, i):
        return {"mp4": self.video[i], "txt": f"video {i}"}


def forward_step(data_iterator, model, args, timers):
    """``train_video.py``'s forward step on CPU ranks (it moves the batch with ``.cuda()``)."""
    batch = next(data_iterator)
    tiny_cogvideo.write_config(args)
    return model.shared_step(batch)


def main(argv, config):
    return tiny_cogvideo.main(argv, OmegaConf.create(copy.deepcopy(config)), SATVideoDiffusionEngine, forward_step,
                              lambda path, args: Videos())
