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


def setup_with_trainable_setting(original, args, model, config_params=None):
    """CogVLM's demos train far more than the LoRA adapters: with ``SAT_PATCHES_TRAINABLE=lora`` the model's
    ``disable_untrainable_params`` is followed by :func:`adapters_only`."""
    if setting() == "lora":
        scripts_choice = getattr(model, "disable_untrainable_params", None)

        def disable_untrainable_params():
            if scripts_choice is not None:
                scripts_choice()
            adapters_only(model)
        model.disable_untrainable_params = disable_untrainable_params  # what SAT calls next
    return original(args, model, config_params)
