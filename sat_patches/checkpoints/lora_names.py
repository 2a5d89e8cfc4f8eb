"""LoRA's names, declared once: SAT's ``LoraLinear`` (and ours) keeps the layer it wraps as ``original`` and its
factors as ``matrix_A.<i>`` (rank x in) and ``matrix_B.<i>`` (out x rank), one pair per partition of a fused
linear, so a checkpoint holds ``<layer>.original.weight``, ``<layer>.matrix_A.0``, ``<layer>.matrix_B.0``, ...
Every "is this a LoRA parameter / layer" question in the package is answered here."""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

BASE, FACTOR_A, FACTOR_B = "original", "matrix_A", "matrix_B"
FACTORS = (FACTOR_A, FACTOR_B)


class FactorKey(NamedTuple):
    layer: str    # the LoRA layer's module path
    factor: str   # FACTOR_A or FACTOR_B
    index: int    # the partition


def factor_key(key: str) -> Optional[FactorKey]:
    """``key`` split as a LoRA factor (``<layer>.matrix_A.<i>``), or None when it is not one."""
    layer, found, rest = key.rpartition(".matrix_")
    which, dot, index = rest.partition(".")
    if not found or which not in ("A", "B") or not dot or not index.isdigit():
        return None
    return FactorKey(layer, "matrix_" + which, int(index))


def is_adapter(name: str) -> bool:
    """A LoRA factor's parameter name (``...matrix_A.0``), or a name inside one (``...matrix_B``)."""
    return any(part in FACTORS for part in name.split("."))


def lora_layers(keys) -> Dict[str, int]:
    """``{module path: number of LoRA partitions}`` from checkpoint keys."""
    layers: Dict[str, int] = {}
    for key in keys:
        found = factor_key(key)
        if found and found.factor == FACTOR_A:
            layers[found.layer] = max(layers.get(found.layer, 0), found.index + 1)
    return layers

