"""DeepSpeed's check that ZeRO supports the run's optimizer, without compiling Muon's kernels first.

``deepspeed.runtime.zero.utils.is_zero_supported_optimizer`` (DeepSpeed 0.19) imports
``deepspeed.runtime.zero.muon.muon_optimizer`` on every call, to add Muon's optimizer to the supported list. That
module wraps its kernels in ``torch.compile`` when imported, which imports most of torch's inductor: 1-1.6 s and
560 modules in every rank that reaches ``deepspeed.initialize`` with ZeRO, whatever its optimizer. An optimizer
whose type is already on the list (Adam, AdamW, FusedAdam, DeepSpeed's CPU optimizers: every SAT run's) is
supported without that import; any other type goes to DeepSpeed's own check, which imports Muon's module and
decides as before.
"""
from __future__ import annotations

from typing import Any, Callable


def is_zero_supported_optimizer(original: Callable[[Any], bool], optimizer: Any) -> bool:
    """``original``'s answer; its module's list, rank and logger are read from its own namespace."""
    namespace = original.__globals__
    if type(optimizer) not in namespace["ZERO_SUPPORTED_OPTIMIZERS"]:
        return original(optimizer)
    if namespace["dist"].get_rank() == 0:  # the line DeepSpeed's own check logs
        namespace["logger"].info(f"Checking ZeRO support for optimizer={optimizer.__class__.__name__} "
                                 f"type={type(optimizer)}")
    return True
