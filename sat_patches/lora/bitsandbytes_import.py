"""bitsandbytes imported without torch's compiler, which it needs only once an NF4 kernel first runs.

As it is imported, bitsandbytes' default backend wraps its 4-bit kernels in ``torch.compile``
(``bitsandbytes/backends/default/ops.py``, ``_try_torch_compile``), and ``torch.compile`` imports
``torch._dynamo`` and ``torch._inductor``: 2.5-3.5 s of CPU time on a 2-core machine, a quarter of the
start-up of every process that imports SAT's ``sat.model.finetune.lora2`` (which imports bitsandbytes whether
or not QLoRA is used), though nothing is compiled before a wrapped kernel is first called, which only QLoRA's
NF4 layers do. :func:`import_bitsandbytes` imports it with ``torch.compile`` deferred while bitsandbytes' code
runs: a function it wraps calls ``torch.compile`` with the same arguments on its first call and runs what that
returns, so the kernels, their results and bitsandbytes' fallback to the plain function where compiling fails
are as they were; only the compiler's import moves to that first call. A bitsandbytes imported before
sat_patches is left as it is.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
from types import ModuleType

import torch


def compile_on_first_call(compile_now):
    """A ``torch.compile`` that returns, for a plain function, a wrapper calling ``compile_now`` (the real
    ``torch.compile``) with the same arguments on its first call; anything else (a module, a decorator
    factory's call without a function) goes to ``compile_now`` at once, or is deferred the same way."""
    def deferred(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=...): the decorator
            return lambda fn: deferred(fn, **kwargs)
        if not inspect.isfunction(model):
            return compile_now(model, **kwargs)
        compiled, lock = [], threading.Lock()

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(compile_now(model, **kwargs))
            return compiled[0](*args, **kw)
        return first_call_compiles
    return deferred


@contextlib.contextmanager
def compiler_deferred():
    """``torch.compile`` is :func:`compile_on_first_call`'s within the block."""
    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        yield
    finally:
        torch.compile = real


def import_bitsandbytes() -> ModuleType:
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    with compiler_deferred():
        return importlib.import_module("bitsandbytes")
