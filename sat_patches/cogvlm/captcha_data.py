"""CAPTCHA data in the layout of CogVLM's fine-tuning demo: a folder of ``<label>.jpg`` images, drawn by the
PyPI ``captcha`` package (the ``demo`` extra) with a seeded source in place of its :mod:`secrets`, so the same
``seed`` gives the same labels and pixels."""
from __future__ import annotations

import os
import random
from typing import Iterable, List

from .tokenizer import DEFAULT_ALPHABET


class _SeededSecrets:
    """The part of :mod:`secrets` that ``captcha.image`` uses, backed by ``random.Random(seed)``."""

    def __init__(self, rng: random.Random):
        self._rng = rng

    def randbelow(self, n: int) -> int:
        return self._rng.randrange(n)

    def randbits(self, k: int) -> int:
        return self._rng.getrandbits(k)

    def choice(self, seq):
        return self._rng.choice(seq)


def make_captcha_dataset(directory: str, n: int, seed: int = 0, alphabet: str = DEFAULT_ALPHABET,
                         length: int = 4, width: int = 160, height: int = 60, quality: int = 90,
                         exclude: Iterable[str] = ()) -> List[str]:
    """Write ``n`` CAPTCHA images ``<label>.jpg`` (distinct labels of ``length`` characters from
    ``alphabet``, none of them in ``exclude``) into ``directory``; returns their paths, sorted."""
    try:
        import captcha.image as captcha_image  # optional: only the CAPTCHA data set needs it
    except ImportError as exc:
        raise ImportError('CAPTCHA images are drawn by the `captcha` package, which is not installed: '
                          'pip install "sat_patches[demo]"') from exc
    seen = set(exclude)
    if n > len(alphabet) ** length - len(seen):
        raise ValueError(f"cannot make {n} distinct labels of {length} characters from {len(alphabet)} symbols")
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    labels: List[str] = []
    while len(labels) < n:
        label = "".join(rng.choice(alphabet) for _ in range(length))
        if label not in seen:
            seen.add(label)
            labels.append(label)
    paths = []
    saved, captcha_image.secrets = captcha_image.secrets, _SeededSecrets(random.Random(seed + 1))
    try:
        generator = captcha_image.ImageCaptcha(width=width, height=height)
        for label in labels:
            path = os.path.join(directory, f"{label}.jpg")
            generator.generate_image(label).convert("RGB").save(path, format="JPEG", quality=quality)
            paths.append(path)
    finally:
        captcha_image.secrets = saved
    return sorted(paths)
