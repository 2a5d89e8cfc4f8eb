"""One construction context: SAT models, layers and mixins are built on the compute device, in the
run's dtype, so a rank never holds a full fp32 CPU copy of the model (the host memory of
THUDM/CogVLM#283 and THUDM/CogVLM#320).

SAT builds on CPU in fp32 wherever a ``device``/``params_dtype`` is not passed down: ``BaseModel``
passes ``device=torch.device('cpu')`` to ``BaseTransformer`` unless ``--use-gpu-initialization``;
LLaMA's ``LMMixin``/``LLaMAMlpMixin`` build ``ColumnParallelLinear`` without ``params_dtype``; CogVLM's
vision-expert mixins default to ``device=torch.device('cpu')`` and fp32. ``get_model`` casts and
moves only once the whole model exists, so a rank holds a full fp32 CPU copy first.

Instead of an edit per class, :func:`build_on` is a :class:`~torch.overrides.TorchFunctionMode` (the
style of accelerate's ``init_on_device``) over tensor factory functions: inside it, a factory call
that names no device or the CPU allocates on the build device, and a float32 (or default-dtype)
factory call allocates in the run's dtype. It is entered around every SAT model construction
(``MetaModel.__call__``: ``get_model``, ``from_pretrained``, models nested in models such as
CogVLM's EVA-CLIP), around ``BaseModel.add_mixin`` and around ``BaseModel.reinit``.

Not intercepted: ``arange``/``linspace``/``tensor`` (index arithmetic and buffers such as rotary
``inv_freq`` keep being computed on CPU, as before, and are moved with the model) and tensors a
caller places on an explicit accelerator device.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import devices
from ..core.registry import Patch, expect_params

# allocation functions whose device/dtype the context decides
_FACTORIES = frozenset({torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full,
                        torch.rand, torch.randn, torch.randint, torch.eye})
_INTEGER_FACTORIES = frozenset({torch.randint})


@dataclass(frozen=True)
class BuildTarget:
    """Where (and in which floating dtype) the current construction allocates."""
    device: torch.device
    dtype: Optional[torch.dtype]


_current: Optional[BuildTarget] = None


def current_build() -> Optional[BuildTarget]:
    """The active :class:`BuildTarget`, or None outside any construction."""
    return _current


def run_dtype(args=None, params_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype SAT's ``get_model`` casts a model to: ``params_dtype`` if given, else fp16/bf16 from args."""
    if params_dtype is not None:
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
    if func in _INTEGER_FACTORIES:
        return False
    if func is torch.full:
        fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        return not isinstance(fill, (bool, int))
    return torch.get_default_dtype() == torch.float32


def _called_by_collectives() -> bool:
    """Tensors torch.distributed/DeepSpeed make for their own messages (SAT may initialise the
    process group from inside a model's ``__init__``) stay where those libraries put them."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.startswith(("torch.distributed", "deepspeed.comm"))


class _BuildMode(TorchFunctionMode):
    def __init__(self, target: BuildTarget):
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and not _called_by_collectives():
            if _is_cpu(kwargs.get("device")):
                kwargs["device"] = self.target.device
            if self.target.dtype is not None and _float_result(func, args, kwargs):
                kwargs["dtype"] = self.target.dtype
        return func(*args, **kwargs)


@contextlib.contextmanager
def build_on(device=None, dtype: Optional[torch.dtype] = None) -> Iterator[BuildTarget]:
    """Allocate new tensors on ``device`` (default: the policy's compute device) and float32 ones in
    ``dtype`` (default: unchanged) inside the block, unless they name another accelerator device.

    Re-entrant: inside an active construction the outermost context decides, so a model built inside
    another model (EVA-CLIP inside CogVLM) follows the outer model's device and dtype.
    """
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
    """Move ``module``'s CPU parameters (and, unless the target is meta, CPU buffers) built outside a
    construction context to the build target, keeping each Parameter's attributes (``model_parallel``
    and friends) and sharing. Float32 tensors take the target dtype."""
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


# --------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------

def _model_args(args, kwargs):
    return args[0] if args else kwargs.get("args")


def _construct_model(original):
    """``SomeModel(args, ...)`` for every SAT model class: build inside :func:`build_on`."""
    def __call__(cls, *args, **kwargs):
        sat_args = _model_args(args, kwargs)
        from sat.helpers import check_if_zero3
        if _current is not None or (sat_args is not None and check_if_zero3(sat_args)):
            return original(cls, *args, **kwargs)  # nested, or DeepSpeed zero.Init places params
        with build_on(devices.compute_device(), run_dtype(sat_args, kwargs.get("params_dtype"))):
            return original(cls, *args, **kwargs)
    return __call__


def _add_mixin(original):
    """A mixin built before ``add_mixin`` (outside any model) joins the model's device and dtype;
    what its ``reinit`` allocates (LoRA layers) is built there too."""
    @functools.wraps(original)
    def add_mixin(self, name, new_mixin, reinit=False):
        with build_on(devices.compute_device(), model_dtype(self)) as target:
            move_to_build(new_mixin, target)
            return original(self, name, new_mixin, reinit=reinit)
    return add_mixin


def _reinit(original):
    """``load_checkpoint`` re-initialises mixins whose keys a checkpoint lacks (LoRA builds layers)."""
    @functools.wraps(original)
    def reinit(self, mixin_names=None):
        with build_on(devices.compute_device(), model_dtype(self)):
            return original(self, mixin_names)
    return reinit


def _expect_type_call(original) -> Optional[str]:
    return None if original is type.__call__ else "MetaModel defines its own __call__"


PATCHES = [
    Patch("build_models_on_device", "sat.model.registry:MetaModel.__call__", _construct_model,
          answers="THUDM/CogVLM#283, #320: BaseModel builds on CPU in fp32 (device=torch.device('cpu'), mixins "
                  "without params_dtype) before get_model casts and moves: a full fp32 CPU copy per rank",
          expect=_expect_type_call),
    Patch("add_mixin_on_device", "sat.model.base_model:BaseModel.add_mixin", _add_mixin,
          answers="THUDM/CogVLM#283, #320: mixins built with device=torch.device('cpu'), fp32 (vision-expert "
                  "mixins, LoRA) stay on CPU in fp32",
          expect=expect_params("name", "new_mixin", "reinit")),
    Patch("reinit_on_device", "sat.model.base_model:BaseModel.reinit", _reinit,
          answers="THUDM/CogVLM#283, #320: layers a mixin's reinit builds (LoRA via load_checkpoint) land on CPU",
          expect=expect_params("mixin_names")),
]
