"""The fine-tuning data set and batch collation of CogVLM's CAPTCHA demo.

Mirrors ``ItemDataset`` of CogVLM ``utils/utils/dataset.py`` (a folder of ``.jpg`` files whose stem is
the label, prompt ``CAPTCHA:``) and ``data_collator`` of ``finetune_demo/finetune_cog{vlm,agent}_demo.py``.
Unreadable images are found when the data set is built and follow ``SAT_PATCHES_BAD_RECORDS`` as JSONL
records do (:func:`sat_patches.data.jsonl.settle`); skipped ones are listed in ``skipped``.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, List, Optional

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..data.jsonl import EmptyDatasetError, folder_images, image_problem, settle  # noqa: F401

logger = logging.getLogger(__name__)

PROMPT = "CAPTCHA:"


class ItemDataset(Dataset):
    """``ItemDataset(image_processor, text_processor, args, data_dir, cross_image_processor=None)``."""

    def __init__(self, image_processor: Callable, text_processor: Callable, args=None, data_dirs: str = "",
                 cross_image_processor: Optional[Callable] = None, prompt: str = PROMPT, **kwargs):
        super().__init__()
        self.image_processor = image_processor
        self.text_processor = text_processor
        self.cross_image_processor = cross_image_processor
        self.prompt = prompt
        self.data_dir = data_dirs
        self.data = self._load(data_dirs)

    def _load(self, data_dir: str) -> List[str]:
        if not os.path.isdir(data_dir):
            raise EmptyDatasetError(f"data folder {data_dir!r} does not exist")
        files = folder_images(data_dir)
        if not files:
            raise EmptyDatasetError(f"no usable CAPTCHA image in {data_dir!r}: it holds no .jpg file")
        checked = [(path, image_problem(path)) for path in files]
        self.skipped = [(path, problem) for path, problem in checked if problem]
        return settle([path for path, problem in checked if not problem],
                      [f"{path}: {problem}" for path, problem in self.skipped], data_dir, what="image")

    @staticmethod
    def label_of(path: str) -> str:
        return os.path.splitext(os.path.basename(path))[0]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        path = self.data[index]
        label = self.label_of(path)
        return self.item(path, label, self.prompt, label)

    def answer_of(self, index: int) -> str:
        return self.label_of(self.data[index])

    def prompt_text(self, index: int) -> str:
        return self.prompt

    def image_of(self, index: int) -> str:
        return self.data[index]

    def item(self, path: str, answer: str, prompt: str, question_id: str) -> dict:
        """The image inputs of ``path`` and the text processor's output for ``answer`` after ``prompt``;
        upstream's empty item when the image became unreadable or the text does not fit."""
        try:
            with Image.open(path) as opened:
                image = opened.convert("RGB")
        except Exception as exc:  # changed since the data set was built: upstream's empty item
            logger.warning("image %s became unreadable: %s", path, exc)
            return {}
        item = {"vision": self.image_processor(image)}
        if self.cross_image_processor is not None:
            item["cross"] = self.cross_image_processor(image)
        text = self.text_processor(answer, prompt)
        if text is None:
            logger.warning("text of %s does not fit max_target_length", path)
            return {}
        return {**item, **text, "question_id": question_id}


def _batched(values):
    """Tensors (lists and arrays made tensors) concatenated on dim 0; anything else: the last value."""
    values = [torch.tensor(v) if isinstance(v, list) else torch.from_numpy(v) if isinstance(v, np.ndarray) else v
              for v in values]
    return torch.cat(values) if isinstance(values[-1], torch.Tensor) else values[-1]


def data_collator(examples, cross_image_processor=None) -> dict:
    """Batch items of :class:`ItemDataset`: tensors are concatenated on dim 0; other values (None,
    the question id) come from the last item; ``vision``/``cross`` become ``vision_*``/``cross_*``.
    Empty items are dropped. Pass ``cross_image_processor`` (anything not None) for CogAgent."""
    examples = [ex for ex in examples if ex]
    if not examples:
        raise ValueError("data_collator: every item of the batch was empty (unreadable or too long)")
    groups = ["vision"] + (["cross"] if cross_image_processor is not None else [])
    batch = {f"{group}_{key}": _batched([ex[group][key] for ex in examples])
             for group in groups for key in examples[-1][group]}
    batch.update({key: _batched([ex[key] for ex in examples])
                  for key in examples[-1] if key not in ("vision", "cross")})
    return batch
