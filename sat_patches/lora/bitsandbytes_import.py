"""bitsandbytes imported without torch's compiler, which it needs only once an NF4 kernel first runs.

As it is imported, bitsandbytes' default backend wraps its 4-bit kernels in ``torch.compile``
(``bitsandbytes/backends/default/ops.py``, ``_try_torch_compile``), and ``torch.compile`` imports
``torch._dynamo`` and ``torch._inductor``: 2.5-3.5 s of CPU time on a 2-core machine, a quarter of the
start-up of every process that imports SAT's ``sat.model.finetune.lora2`` (which imports bitsandbytes whether
or not QLoRA is used), though nothing is compiled before a wrapped kernel is first called, which only QLoRA's
NF4 layers do. :func:`import_bitsandbytes` imports it with ``torch.compile`` deferred to each kernel's first call
while bitsandbytes' code runs (:mod:`sat_patches.runtime.compiler`). A bitsandbytes imported before sat_patches is
left as it is.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

from ..runtime.compiler import compiler_deferred


def import_bitsandbytes() -> ModuleType:
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    with compiler_deferred():
        return importlib.import_module("bitsandbytes")
