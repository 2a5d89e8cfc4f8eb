"""Opening a checkpoint file never runs code from it.

A ``.pt`` file is a pickle: unpickled in full it can call any function it names. Files are loaded with
torch's ``weights_only=True`` unpickler and an allow-list of the types SAT and DeepSpeed saves hold: numpy's
RNG state (``ndarray``, ``dtype``, ``_reconstruct``: served by the checking stand-ins of :mod:`.safe_numpy`)
and DeepSpeed's ``LossScaler``/``DynamicLossScaler``, ``ZeroStageEnum`` and ``fragment_address`` (ZeRO
optimizer shards). A file that names anything else is refused before any of it is unpickled, naming the
opt-in ``SAT_PATCHES_TRUST_CHECKPOINTS=1`` (files loaded in full, as SAT and DeepSpeed do).
"""
from __future__ import annotations

import contextlib
import importlib
import mmap
from typing import List

import torch

from ..core import settings

from . import safe_numpy

TRUST_ENV = "SAT_PATCHES_TRUST_CHECKPOINTS"

# numpy names a SAT save refers to, each served by a checking stand-in
NUMPY_STANDINS = {
    "numpy.ndarray": safe_numpy.ArrayType,
    "numpy.dtype": safe_numpy.DTypeBuilder,
    "numpy._core.multiarray._reconstruct": safe_numpy.ArrayBuilder,   # numpy >= 2
    "numpy.core.multiarray._reconstruct": safe_numpy.ArrayBuilder,    # numpy < 2
}

# "module:qualified name" of every global a SAT/DeepSpeed save refers to beyond torch's own
ALLOWED = tuple(NUMPY_STANDINS) + (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that names code it would run when unpickled."""


def trusted() -> bool:
    return settings.read(TRUST_ENV)


def _resolve(name: str):
    module, _, attr = name.rpartition(".")
    try:
        obj = importlib.import_module(module)
    except ImportError:  # numpy's other major version, or no DeepSpeed: nothing of it to allow
        return None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def allowed_globals() -> List[object]:
    """The objects the unpickler may use for the names of :data:`ALLOWED`: numpy's are checking stand-ins
    (:data:`NUMPY_STANDINS`), the others the objects that exist here."""
    others = [_resolve(n) for n in ALLOWED if n not in NUMPY_STANDINS]
    return safe_numpy.standins(NUMPY_STANDINS) + [obj for obj in others if obj is not None]


def check(path: str) -> None:
    """Refuse ``path`` when its pickle names a global outside the allow-list (read, not run)."""
    if trusted():
        return
    allowed = {f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', getattr(o, '__name__', ''))}"
               for o in allowed_globals()} | set(ALLOWED)
    unknown = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed)
    if unknown:
        raise UnsafeCheckpointError(
            f"'{path}' names {', '.join(unknown)}, which a SAT or DeepSpeed checkpoint does not hold; unpickling "
            f"it could run code. Not loaded. Set {TRUST_ENV}=1 only if you trust whoever made this file: it is "
            f"then unpickled in full, and anything it names runs on this machine")


def load(path: str, map_location="cpu", mmap: bool = False):
    """``torch.load`` of a checkpoint file with ``weights_only=True`` and the SAT/DeepSpeed
    allow-list (``mmap``: tensors are read when used, from a private mapping); in full only when
    :func:`trusted`."""
    check(path)
    with _privately_mapped(mmap):
        if trusted():
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=False)
        try:
            with torch.serialization.safe_globals(allowed_globals()):
                return safe_numpy.finish(torch.load(path, map_location=map_location, mmap=mmap, weights_only=True))
        except safe_numpy.UnsafeNumpyError as exc:
            raise UnsafeCheckpointError(f"'{path}': {exc}") from None


def _privately_mapped(mapped: bool):
    """``torch.load(mmap=True)`` maps ``MAP_PRIVATE`` inside the block, whatever default the program set
    (``torch.serialization.set_default_mmap_options``): parameters may be the mapped tensors, and a
    write to them (training) must never reach the checkpoint file."""
    if not mapped or not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no such option, torch maps privately
        return contextlib.nullcontext()
    return torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)


def _torch_load(f, map_location=None, *args, **kwargs):
    """``torch.load``'s signature, through :func:`load`."""
    return load(f, map_location=map_location)


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    """``owner.<name>`` is ``value`` inside the block; after it, what ``owner`` itself held (or nothing)."""
    own = vars(owner).get(name, _replaced)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _replaced:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def deepspeed_loads_safely(engine):
    """DeepSpeed's checkpoint engine unpickles in full (``weights_only=False``); inside this block
    the engine's loads go through :func:`load`."""
    return _replaced(engine.checkpoint_engine, "load", _torch_load)


class _TorchWithSafeLoad:
    """The ``torch`` module as one module's code sees it: everything torch's, except ``load`` (:func:`load`)."""
    load = staticmethod(_torch_load)

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


def module_loads_safely(module):
    """Inside the block, ``torch.load`` called by ``module``'s code (e.g. SAT's ``sat.training.model_io``, whose
    ZeRO-3 path loads with no ``weights_only``) goes through :func:`load`."""
    return _replaced(module, "torch", _TorchWithSafeLoad(module.torch))
