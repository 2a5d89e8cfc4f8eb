"""Construction on a device: :func:`build_on` is a context manager (as accelerate's ``init_empty_weights``)
under which every float tensor factory builds on the target device in the run's dtype, so SAT models, layers
and mixins never hold a full fp32 CPU copy of the model; :func:`move_to_build` moves what was built elsewhere.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import devices

# allocation functions whose device/dtype the context decides
_FACTORIES = frozenset({torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full,
                        torch.rand, torch.randn, torch.randint, torch.eye})

# draws that change nothing on meta, but whose Python reference imports torch's compiler (2-3 s at start-up)
_META_DRAWS = frozenset({torch.Tensor.normal_, torch.nn.init.normal_})


@dataclass(frozen=True)
class BuildTarget:
    """Where (and in which floating dtype) the current construction allocates."""
    device: torch.device
    dtype: Optional[torch.dtype]


_current: Optional[BuildTarget] = None


def current_build() -> Optional[BuildTarget]:
    return _current


_NAMED = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def run_dtype(args=None, params_dtype=None) -> torch.dtype:
    """The dtype SAT's ``get_model`` casts a model to: ``params_dtype`` if given (a torch dtype, or a name as
    CogVideoX's ``DiffusionTransformer(dtype="bf16")`` is given it), else fp16/bf16 from args."""
    if isinstance(params_dtype, str):
        params_dtype = _NAMED.get(params_dtype)
    if isinstance(params_dtype, torch.dtype) and params_dtype.is_floating_point:
        return params_dtype
    if getattr(args, "fp16", False):
        return torch.half
    if getattr(args, "bf16", False):
        return torch.bfloat16
    return torch.float32


def model_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The floating dtype of a model's first floating parameter (its run dtype), or None."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _is_cpu(device) -> bool:
    return device is None or torch.device(device).type == "cpu"


def _float_result(func, args, kwargs) -> bool:
    """Would this factory call produce a float32/default-dtype tensor?"""
    dtype = kwargs.get("dtype")
    if dtype is not None:
        return dtype == torch.float32
    if func is torch.randint:
        return False
    if func is torch.full:
        fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        return not isinstance(fill, (bool, int))
    return torch.get_default_dtype() == torch.float32


class _BuildMode(TorchFunctionMode):
    def __init__(self, target: BuildTarget):
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _META_DRAWS:
            drawn = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if getattr(drawn, "is_meta", False):
                return drawn
        # tensors torch.distributed/DeepSpeed make for their own messages stay where those libraries put them
        if func in _FACTORIES and not sys._getframe(1).f_globals.get("__name__", "").startswith(
                ("torch.distributed", "deepspeed.comm")):
            if _is_cpu(kwargs.get("device")):
                kwargs["device"] = self.target.device
            if self.target.dtype is not None and _float_result(func, args, kwargs):
                kwargs["dtype"] = self.target.dtype
        return func(*args, **kwargs)


@contextlib.contextmanager
def build_on(device=None, dtype: Optional[torch.dtype] = None) -> Iterator[BuildTarget]:
    """Allocate new tensors on ``device`` (default: the compute device) and float32 ones in ``dtype`` inside
    the block, unless they name an accelerator device. Re-entrant: the outermost context decides."""
    global _current
    if _current is not None:
        yield _current
        return
    target = BuildTarget(torch.device(device) if device is not None else devices.compute_device(), dtype)
    _current = target
    try:
        with _BuildMode(target):
            yield target
    finally:
        _current = None


def move_to_build(module: torch.nn.Module, target: Optional[BuildTarget] = None) -> None:
    """Move ``module``'s CPU parameters (and, unless the target is meta, buffers) to the build target, keeping
    each Parameter's attributes and sharing; float32 tensors take the target dtype."""
    target = target or current_build()
    if target is None:
        return
    moved = {}

    def new_dtype(t: torch.Tensor) -> torch.dtype:
        return target.dtype if (target.dtype is not None and t.dtype == torch.float32) else t.dtype

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=target.device, dtype=new_dtype(t))

    def needs_move(t: torch.Tensor) -> bool:
        if not _is_cpu(t.device):  # meta, or an accelerator the caller chose
            return False
        return target.device.type != "cpu" or new_dtype(t) != t.dtype

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not needs_move(p):
                continue
            if id(p) not in moved:
                new = torch.nn.Parameter(convert(p), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                moved[id(p)] = new
            sub._parameters[name] = moved[id(p)]
        if target.device.type == "meta":
            continue  # buffers hold computed values (rotary inv_freq) that meta would lose
        for name, b in list(sub._buffers.items()):
            if b is not None and needs_move(b):
                sub._buffers[name] = convert(b)
