"""Coloured shapes drawn locally, in JSON Lines (:mod:`sat_patches.data.jsonl`): a task the tiny CPU demo's
CogVLM learns within a minute. Each image is one large filled shape in one of four colours; every record asks
its colour, so a random model scores 0% and a trained one nearly all. The same ``seed`` gives the same data.
"""
from __future__ import annotations

import os
import random
from typing import Dict, List, Tuple

import numpy as np
from PIL import Image, ImageDraw

from ..data.jsonl import write_jsonl

COLOURS: Dict[str, Tuple[int, int, int]] = {
    "red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 215), "yellow": (230, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
PROMPT = "What colour is the shape?"
IMAGE_SIZE = 112


def _jitter(rng: random.Random, rgb: Tuple[int, int, int], spread: int) -> Tuple[int, ...]:
    return tuple(min(255, max(0, c + rng.randint(-spread, spread))) for c in rgb)


def draw_shape(rng: random.Random, colour: str, shape: str, size: int = IMAGE_SIZE):
    """A PIL image of one ``shape`` in ``colour``."""
    background = _jitter(rng, (235, 235, 235), 15)
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-12, 13, (size, size, 3))
    pixels = np.clip(np.full((size, size, 3), background, dtype=np.int64) + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    side = rng.randint(size * 11 // 20, size * 9 // 10)  # large: most image patches show the colour
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    fill = _jitter(rng, COLOURS[colour], 25)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + side // 2, box[1]), (box[2], box[3]), (x0, box[3])], fill=fill)
    return image


def make_shapes_dataset(path: str, n: int, seed: int = 0) -> int:
    """Draw ``n`` images into the folder named after ``path`` without ``.jsonl`` (``data/train.jsonl`` ->
    ``data/train/``) and write one record per image to ``path``: :data:`PROMPT` answered by the colour.
    Colours and shapes cycle, so every colour is seen equally often, on every shape. Returns ``n``."""
    folder = os.path.splitext(path)[0]
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    records: List[Dict] = []
    for i in range(n):
        colour, shape = names[i % len(names)], SHAPES[(i // len(names)) % len(SHAPES)]
        name = f"{i:04d}.png"
        draw_shape(rng, colour, shape).save(os.path.join(folder, name))
        rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(os.path.abspath(path)))
        records.append({"image": rel, "prompt": PROMPT, "answer": colour})
    write_jsonl(path, records)
    return n


TOKENIZER_VOCAB = 480  # room for a piece per word of the prompts and answers (the model's vocabulary is 1024)


def tokenizer_text() -> List[str]:
    """Sentences that give the tiny tokenizer (of :data:`TOKENIZER_VOCAB` pieces) one piece per colour and
    shape name, and per word of the prompt."""
    words = list(COLOURS) + list(SHAPES)
    return [f"{PROMPT} {word}" for word in words for _ in range(300)]
