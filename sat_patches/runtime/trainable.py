"""What trains: ``SAT_PATCHES_TRAINABLE=lora`` leaves only the LoRA adapters trainable, ``demo`` the script's
own choice.
"""
from __future__ import annotations

from ..checkpoints.lora_names import is_adapter
from ..core import settings

ENV = "SAT_PATCHES_TRAINABLE"


def setting() -> str:
    return settings.read(ENV)


def adapters_only(model) -> int:
    """Leave only the LoRA matrices trainable; returns how many parameters train."""
    named = list(model.named_parameters())
    if not any(is_adapter(n) for n, _ in named):
        raise ValueError(f"{ENV}=lora but the model has no LoRA parameters (matrix_A/matrix_B): add --use_lora "
                         f"(or --use_qlora), or set {ENV}=demo")
    for name, p in named:
        p.requires_grad_(is_adapter(name))
    return sum(p.numel() for n, p in named if is_adapter(n))
