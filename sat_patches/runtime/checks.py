"""LoRA arguments that cannot work, refused before the model is built with a message that says what to change."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from ..checkpoints.model_config import read_model_config


class BadInputError(ValueError):
    """An argument that cannot work; the message says what to change."""


def bitsandbytes_problem() -> Optional[str]:
    """None when ``bitsandbytes`` with ``LinearNF4`` imports, else why not."""
    try:
        from bitsandbytes.nn import LinearNF4  # noqa: F401  (whether it imports is the question asked)
    except Exception as exc:  # noqa: BLE001  (ImportError, OSError of a missing CUDA binary, ...)
        return f"{type(exc).__name__}: {exc}"
    return None


def check_lora_args(lora_rank: Optional[int] = None, layer_range: Optional[Sequence[int]] = None,
                    num_layers: Optional[int] = None, use_qlora: bool = False,
                    from_pretrained: Optional[str] = None, what: str = "LoRA") -> None:
    """Raise :class:`BadInputError` for a LoRA set-up that cannot work."""
    if lora_rank is not None and (not isinstance(lora_rank, int) or lora_rank <= 0):
        raise BadInputError(f"{what} rank {lora_rank!r} must be a positive integer: pass e.g. --lora_rank 8")
    if num_layers is None and from_pretrained and os.path.isdir(from_pretrained):
        num_layers = int(read_model_config(from_pretrained)["num_layers"])
    if layer_range is not None:
        layers = list(layer_range)
        if not layers:
            raise BadInputError(f"{what} layer_range is empty: pass layer indices, e.g. --layer_range 0 1 2, "
                                f"or leave it out for every layer")
        if num_layers is not None:
            bad = sorted({i for i in layers if not (0 <= int(i) < num_layers)})
            if bad:
                raise BadInputError(f"{what} layer_range has layer(s) {bad} outside the model's {num_layers} layers: "
                                    f"use indices 0..{num_layers - 1} (e.g. --layer_range 0 {min(15, num_layers - 1)})")
    if use_qlora:
        problem = bitsandbytes_problem()
        if problem:
            raise BadInputError(f"--use_qlora needs a working bitsandbytes (`from bitsandbytes.nn import LinearNF4` "
                                f"fails: {problem}): install it (pip install bitsandbytes) or drop --use_qlora")


def check_finetune_args(args) -> None:
    """:func:`check_lora_args` on a parsed CogVLM/CogAgent finetune namespace."""
    if getattr(args, "use_lora", False) or getattr(args, "use_qlora", False):
        check_lora_args(getattr(args, "lora_rank", None), getattr(args, "layer_range", None),
                        use_qlora=getattr(args, "use_qlora", False),
                        from_pretrained=getattr(args, "from_pretrained", None))
