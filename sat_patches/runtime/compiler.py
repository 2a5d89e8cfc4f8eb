"""``torch.compile`` deferred to the first call of the function it wraps.

Libraries that wrap their kernels in ``torch.compile`` when imported (bitsandbytes' 4-bit kernels, DeepSpeed's Muon
update) make their importer pay for torch's compiler, ``torch._dynamo`` and most of ``torch._inductor`` (1.3-3.5 s
of CPU time on a 2-core machine), though nothing is compiled before a wrapped function is first called. Inside
:func:`compiler_deferred`, ``torch.compile`` of a plain function returns a wrapper that calls the real
``torch.compile`` with the same arguments on its first call and runs what that returns: the kernels, their results
and a library's fallback where compiling fails are as they were; only the compiler's import moves to that first
call.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading

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
