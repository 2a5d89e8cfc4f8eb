"""Image preprocessing of CogVLM with PIL, numpy and torch only (torchvision does not import beside
the CPU torch build here).

Mirrors ``BlipImageEvalProcessor`` and ``get_image_processor`` of CogVLM ``utils/utils/vision.py``:
resize to ``size x size`` with bicubic interpolation, scale to [0, 1], normalise with the CLIP
mean/std, and return the inputs the EVA tower takes (``image``, a 1-token ``input_ids`` for [CLS],
``position_ids`` None, ``attention_mask`` of ones).
"""
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


class ImageInputs:
    """Callable giving the EVA tower's inputs for one image (upstream
    ``blip2_image_processor_func_with_inputs`` bound to a processor)."""

    def __init__(self, processor: BlipImageEvalProcessor):
        self.processor = processor

    def __call__(self, image: Image.Image) -> dict:
        return {
            "image": self.processor(image).unsqueeze(0),
            "input_ids": torch.zeros(1, 1, dtype=torch.long),
            "position_ids": None,
            "attention_mask": torch.ones(1, 1, dtype=torch.long),
        }


def get_image_processor(image_size: int) -> ImageInputs:
    return ImageInputs(BlipImageEvalProcessor(image_size))
