"""A JSON Lines conversation dataset for CogVLM and CogAgent, and the ``create_dataset_function`` that picks it.

Records (format and checks: :mod:`sat_patches.data.jsonl`) become items like ``ItemDataset``'s, the prompt
rendered with the tokenizer's template from the sample's history and query. A sample whose text would not
fit ``max_length`` is a problem like any other: named by ``file:line`` when the dataset is built.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional

from ..data.jsonl import Sample, read_samples, settle
from .dataset import ItemDataset
from .text_processor import IMAGE_TAG


def length_problem(text_processor, prompt: str, answer: str) -> Optional[str]:
    """Why the text processor (ours or upstream's ``llama2_text_processor``) would drop the sample or cut its
    answer, or None when it fits."""
    room = getattr(text_processor, "answer_room", 10)  # upstream's processor returns None within 10 tokens
    limit = text_processor.max_target_length
    encode = partial(text_processor.tokenizer.encode, add_special_tokens=False)
    parts = prompt.split(IMAGE_TAG)  # bos, the prompt's tokens and each image's slots
    context = 1 + sum(len(encode(p)) for p in parts) + (len(parts) - 1) * (text_processor.image_length + 2)
    total = context + len(encode(answer)) + 1
    if context > limit - room or total > limit:
        return (f"{total} tokens with the image ({context} before the answer) do not fit max_length {limit}: "
                f"shorten the record or raise --max_length (MAX_LENGTH)")
    return None


class JsonlDataset(ItemDataset):
    """``JsonlDataset(image_processor, text_processor, args, path, cross_image_processor=None)``."""

    def _load(self, path: str) -> List[Sample]:
        samples, problems = read_samples(path)
        fitting = []
        for sample in samples:
            problem = length_problem(self.text_processor, self.prompt_of(sample), sample.answer)
            if problem:
                problems.append(f"{sample.where}: {problem}")
            else:
                fitting.append(sample)
        return settle(fitting, problems, path)

    def prompt_of(self, sample: Sample) -> str:
        return self.text_processor.history_to_prompt(sample.query, sample.history)

    def answer_of(self, index: int) -> str:
        return self.data[index].answer

    def prompt_text(self, index: int) -> str:
        return self.prompt_of(self.data[index])

    def image_of(self, index: int) -> str:
        return self.data[index].image

    def __getitem__(self, index):
        sample = self.data[index]
        return self.item(sample.image, sample.answer, self.prompt_of(sample), sample.id)


def create_dataset_function(image_processor: Callable, text_processor: Callable, *rest) -> ItemDataset:
    """Upstream demos' signature: ``(image_processor, text_processor, cross_image_processor, path, args)``
    (CogAgent's and today's CogVLM demo) or ``(image_processor, text_processor, path, args)`` (earlier CogVLM
    demos). A ``.jsonl`` file gives a :class:`JsonlDataset`, a folder the ``<label>.jpg`` ``ItemDataset``."""
    if len(rest) not in (2, 3):
        raise TypeError(f"create_dataset_function takes (image_processor, text_processor, [cross_image_processor,] "
                        f"path, args): got {2 + len(rest)} arguments")
    cross, path, args = rest if len(rest) == 3 else (None, *rest)
    cls = JsonlDataset if str(path).endswith(".jsonl") else ItemDataset
    return cls(image_processor, text_processor, args, path, cross_image_processor=cross)
