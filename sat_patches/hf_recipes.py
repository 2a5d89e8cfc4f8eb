"""The one version set the README's Hugging Face recipes were run with: ``pip install "sat_patches[hf]"``.

The released models' remote code predates transformers 5 and breaks outside a narrow window of its dependencies
(:data:`BROKEN_4BIT`). ``setup.py`` reads :data:`PINS` as text, ``sat-patches doctor`` compares what is installed
against it, the README states the set (a test keeps the three equal). Plain Python: no torch, no SAT.
"""
from __future__ import annotations

import re

# torch is never pinned: the user's own CUDA build stays (the set was run with torch 2.11 + CUDA 13)
PINS = ("transformers==4.41.2", "accelerate==0.30.1", "peft==0.11.1", "bitsandbytes==0.50.2")
TORCH_MEASURED = "torch 2.11 + CUDA 13"
EXTRA = 'pip install "sat_patches[hf]"'

# (transformers, accelerate) measured to break the 4-bit recipe, and the ranges doctor reads as that pair:
# transformers up to the pinned 4.41 line hands a quantised model to accelerate's dispatch_model, and
# accelerate from 1.0 on refuses ``.to`` there
BROKEN_4BIT = ("4.41.2", "1.15.0")
LAST_TRANSFORMERS_OF_THE_PAIR = (4, 41)
FIRST_ACCELERATE_OF_THE_PAIR = (1, 0)
FIRST_TRANSFORMERS_WITHOUT_REMOTE_CODE = (5, 0)


def pinned(name: str) -> str:
    """The pinned version of ``name`` (a distribution of :data:`PINS`)."""
    return dict(pin.split("==") for pin in PINS)[name]


def release(version: str) -> tuple:
    """The leading numbers of a version string: ``"4.41.2"`` -> ``(4, 41, 2)``, ``"1.0.0rc1"`` -> ``(1, 0, 0)``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()
