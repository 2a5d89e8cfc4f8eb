"""Prompt templates and the training-time text processor of CogVLM (upstream ``utils/utils/language.py``).

``<EOI>`` in a prompt marks the image: ``image_length + 2`` slots (boi, image tokens, eoi) that the ``eva``
mixin fills. The processor returns upstream's tensors, padded to ``max_target_length``.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

import numpy as np
import torch

IMAGE_TAG = "<EOI>"
IMAGE_PLACEHOLDER = -100


def base_prompt(query: str, history: List[Tuple[str, str]]) -> str:
    return IMAGE_TAG + query


def chat_prompt(query: str, history: List[Tuple[str, str]]) -> str:
    turns = "".join(f"{q} [/INST] {a} [INST] " for q, a in history)
    return f"{IMAGE_TAG} [INST] {turns}{query} [/INST] "


def vqa_prompt(query: str, history: List[Tuple[str, str]]) -> str:
    return f"{IMAGE_TAG}Question: {query} Short answer:"  # one question: upstream keeps no history here


def chat_old_prompt(query: str, history: List[Tuple[str, str]]) -> str:
    turns = "".join(f"{q} Answer: {a}\nQuestion: " for q, a in history)
    return f"{IMAGE_TAG}Question: {turns}{query} Answer:"


PROMPT_TEMPLATES = {"base": base_prompt, "chat": chat_prompt, "vqa": vqa_prompt, "chat_old": chat_old_prompt}
"""Upstream's ``_history_to_prompt`` (CogVLM ``utils/utils/language.py``); ``chat_old`` is CogVLM v1.1's chat
format. ``base`` and ``vqa`` keep no history: a conversation's earlier turns are dropped there."""


class TextProcessor:
    """``llama2_text_processor``: ``processor(caption, prompt)`` -> dict of (1, ...) tensors, or None
    when the prompt leaves fewer than ``answer_room`` tokens (upstream: 50) of ``max_target_length``."""

    def __init__(self, tokenizer, max_target_length: int = 2048, image_length: int = 257, answer_room: int = 50):
        self.tokenizer = tokenizer
        self.max_target_length = max_target_length
        self.image_length = image_length
        self.answer_room = answer_room

    def history_to_prompt(self, query: str, history=()) -> str:
        return PROMPT_TEMPLATES[getattr(self.tokenizer, "signal_type", "base")](query, list(history))

    @staticmethod
    def strip_tags(text: str) -> str:
        return re.sub("<pad>|<s>|</s>|<EOI>", "", text)

    def _encode_with_images(self, text: str) -> List[int]:
        first, *rest = text.split(IMAGE_TAG)
        ids = self.tokenizer.encode(first, add_special_tokens=False)
        for part in rest:
            ids += [IMAGE_PLACEHOLDER] + self.tokenizer.encode(part, add_special_tokens=False)
        return ids

    def __call__(self, caption: str, prompt: str = "") -> Optional[dict]:
        if IMAGE_TAG not in prompt:
            prompt = self.history_to_prompt(self.strip_tags(prompt))
        ids = [self.tokenizer.bos_token_id] + self._encode_with_images(prompt)
        n_images = prompt.count(IMAGE_TAG)
        context_length = len(ids) + n_images * (self.image_length + 1)
        if context_length > self.max_target_length - self.answer_room:
            return None
        ids += self._encode_with_images(caption)
        ids = ids[: self.max_target_length - self.image_length - 5] + [self.tokenizer.eos_token_id]

        # expand each placeholder into boi + image tokens + eoi (token id 0, filled by the eva mixin)
        expanded, image_position = [], []
        for token in ids:
            if token == IMAGE_PLACEHOLDER:
                expanded += [0] * (self.image_length + 1)
                image_position.append(len(expanded))
                expanded.append(0)
            else:
                expanded.append(token)
        length, size = len(expanded), self.max_target_length
        if length > size:
            raise ValueError(f"sequence of {length} tokens exceeds max_target_length {size}")
        input_ids = np.array(expanded + [self.tokenizer.pad_token_id] * (size - length), dtype=np.int64)
        labels = np.full(size, -100, dtype=np.int64)
        labels[context_length:length] = expanded[context_length:]
        image_embed, vision_expert, image_rope = (np.zeros(size, dtype=np.int64) for _ in range(3))
        for eoi in image_position:
            boi = eoi - self.image_length - 1
            image_embed[boi: eoi + 1] = 1
            vision_expert[boi: eoi] = 1
            image_rope[boi + 1: eoi] = 1
            labels[boi: eoi + 1] = -100
        # upstream: padding is attended to (mask of ones), causally
        attention_mask = np.tril(np.ones((self.max_target_length, self.max_target_length), dtype=np.int64))
        starts = np.ones(self.max_target_length, dtype=np.int64)
        starts[1:] = (image_rope[1:] == 0) | (image_rope[1:] != image_rope[:-1])
        position_ids = np.cumsum(starts) - 1

        as_row = lambda a: torch.from_numpy(np.ascontiguousarray(a)).unsqueeze(0)  # noqa: E731
        return {
            "input_ids": as_row(input_ids), "labels": as_row(labels), "position_ids": as_row(position_ids),
            "attention_mask": as_row(attention_mask).unsqueeze(0), "image_embed_mask": as_row(image_embed),
            "context_length": torch.tensor([context_length], dtype=torch.long), "image_position": image_position,
            "vision_expert_mask": as_row(vision_expert), "image_rope_mask": as_row(image_rope),
        }


def llama2_text_processor(tokenizer, max_target_length=2048, image_length=257, model=None):
    """Upstream's constructor name and signature."""
    return TextProcessor(tokenizer, max_target_length, image_length)
