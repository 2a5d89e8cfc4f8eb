"""Generate a CAPTCHA data set in the layout of CogVLM's fine-tuning demo: a folder of ``.jpg``
images whose file stem is the label (CogVLM ``finetune_demo``, data in ``archive_split/train|valid``).

Images are drawn by the PyPI ``captcha`` package (``ImageCaptcha``), installed by the ``demo`` extra
(``pip install "sat_patches[demo]"``). That package takes its
randomness from :mod:`secrets`, so the generator swaps in a seeded source while it draws: the same
``seed`` gives the same labels and the same pixels.
"""
from __future__ import annotations

import contextlib
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


DEMO_EXTRA = 'pip install "sat_patches[demo]"'


def captcha_module():
    """``captcha.image``, or an ImportError that names the extra installing it."""
    try:
        import captcha.image as captcha_image  # optional: only the CAPTCHA data set needs it (the demo extra)
    except ImportError as exc:
        raise ImportError(f"CAPTCHA images are drawn by the `captcha` package, which is not installed: "
                          f"{DEMO_EXTRA}") from exc
    return captcha_image


@contextlib.contextmanager
def _seeded_captcha(captcha_image, rng: random.Random):
    saved = getattr(captcha_image, "secrets", None)
    captcha_image.secrets = _SeededSecrets(rng)
    try:
        yield captcha_image
    finally:
        captcha_image.secrets = saved


def make_captcha_dataset(directory: str, n: int, seed: int = 0, alphabet: str = DEFAULT_ALPHABET,
                         length: int = 4, width: int = 160, height: int = 60, quality: int = 90,
                         exclude: Iterable[str] = ()) -> List[str]:
    """Write ``n`` CAPTCHA images ``<label>.jpg`` (distinct labels of ``length`` characters from
    ``alphabet``, none of them in ``exclude``) into ``directory``; returns their paths, sorted."""
    captcha_image = captcha_module()
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
    with _seeded_captcha(captcha_image, random.Random(seed + 1)):
        generator = captcha_image.ImageCaptcha(width=width, height=height)
        for label in labels:
            path = os.path.join(directory, f"{label}.jpg")
            generator.generate_image(label).convert("RGB").save(path, format="JPEG", quality=quality)
            paths.append(path)
    return sorted(paths)
