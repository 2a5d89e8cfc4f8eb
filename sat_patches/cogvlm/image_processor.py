"""Image preprocessing of CogVLM (upstream ``BlipImageEvalProcessor``, ``get_image_processor``) with PIL,
numpy and torch only: bicubic resize, scale to [0, 1], CLIP mean/std, and the EVA tower's inputs."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class BlipImageEvalProcessor:
    def __init__(self, image_size: int = 384, mean=None, std=None):
        self.image_size = int(image_size)
        self.mean = torch.tensor(mean or CLIP_MEAN, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std or CLIP_STD, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """PIL image -> float tensor (3, size, size)."""
        image = image.convert("RGB").resize((self.image_size, self.image_size), resample=Image.BICUBIC)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (pixels - self.mean) / self.std


def get_image_processor(image_size: int):
    """The EVA tower's inputs for one image (upstream ``blip2_image_processor_func_with_inputs``)."""
    processor = BlipImageEvalProcessor(image_size)
    return lambda image: {"image": processor(image).unsqueeze(0), "input_ids": torch.zeros(1, 1, dtype=torch.long),
                          "position_ids": None, "attention_mask": torch.ones(1, 1, dtype=torch.long)}
