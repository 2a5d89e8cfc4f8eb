"""Opening a checkpoint file never runs code from it.

A ``.pt`` file is a pickle: unpickled in full (``weights_only=False``) it can call any function it
names, so a checkpoint shared by someone else can run their code on the machine that loads it.
torch's ``weights_only=True`` unpickler builds only tensors, containers and numbers, plus the types
it is told are safe. SAT and DeepSpeed checkpoints need exactly these (found with
``torch.serialization.get_unsafe_globals_in_checkpoint`` on saves of SAT's ``training_main`` with
RNG states on, ZeRO stages 0 and 2, fp32/bf16, LoRA, model-parallel size 1 and 2):

* ``mp_rank_XX_model_states.pt``: numpy's RNG state, an array (``numpy.ndarray``, rebuilt through
  numpy's ``_reconstruct``) of ``numpy.dtype``. These names get checking stand-ins
  (:mod:`.safe_numpy`), never numpy's own: those restore any saved dtype state, and an object dtype
  flagged as holding no references makes numpy read the file's bytes as pointers (a crash);
* ``*_optim_states.pt`` (ZeRO): DeepSpeed's ``LossScaler`` (``DynamicLossScaler`` with fp16), ``ZeroStageEnum`` and
  ``fragment_address``.

A file that names anything else is refused before any of it is unpickled, with the names and the
opt-in: ``SAT_PATCHES_TRUST_CHECKPOINTS=1`` loads files in full, as SAT and DeepSpeed do.
"""
from __future__ import annotations

import contextlib
import importlib
import mmap
from typing import Callable, List, Optional

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
    names = {n: c for n, c in NUMPY_STANDINS.items() if n in ALLOWED}
    others = [n for n in ALLOWED if n not in NUMPY_STANDINS]
    return safe_numpy.standins(names) + [obj for obj in map(_resolve, others) if obj is not None]


def _allowed_names() -> set:
    return {f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', getattr(o, '__name__', ''))}"
            for o in allowed_globals()} | set(ALLOWED)


def check(path: str) -> None:
    """Refuse ``path`` when its pickle names a global outside the allow-list (read, not run)."""
    if trusted():
        return
    scan: Optional[Callable] = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if scan is None:
        raise UnsafeCheckpointError(
            f"torch {torch.__version__} cannot check '{path}' for code before loading it (torch >= 2.5 can): "
            f"upgrade torch, or set {TRUST_ENV}=1 if you trust whoever made this file (it is then unpickled in "
            f"full, which runs any code it names)")
    unknown = sorted(set(scan(path)) - _allowed_names())
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
    setter = getattr(torch.serialization, "set_default_mmap_options", None)
    if setter is None:  # torch 2.1: always private
        return contextlib.nullcontext()
    if isinstance(setter, type):  # torch >= 2.5: a context manager
        return setter(mmap.MAP_PRIVATE)
    current = getattr(torch.serialization, "get_default_mmap_options", None)
    previous = current() if current else getattr(torch.serialization, "_default_mmap_options", mmap.MAP_PRIVATE)
    return _set_for_the_block(setter, previous)


@contextlib.contextmanager
def _set_for_the_block(setter, previous):
    """torch 2.2-2.4's plain ``set_default_mmap_options``: private inside the block, ``previous`` after."""
    setter(mmap.MAP_PRIVATE)
    try:
        yield
    finally:
        setter(previous)


@contextlib.contextmanager
def deepspeed_loads_safely(engine):
    """DeepSpeed's checkpoint engine unpickles in full (``weights_only=False``); inside this block
    the engine's loads go through :func:`load`."""
    checkpoint_engine = engine.checkpoint_engine
    own = vars(checkpoint_engine).get("load")

    def safe(path, map_location=None, *args, **kwargs):
        return load(path, map_location=map_location)
    checkpoint_engine.load = safe
    try:
        yield
    finally:
        if own is None:
            del checkpoint_engine.load
        else:
            checkpoint_engine.load = own


class _TorchWithSafeLoad:
    """The ``torch`` module as one module's code sees it: everything torch's, except ``load`` (:func:`load`)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def load(f, map_location=None, *args, **kwargs):
        return load(f, map_location=map_location)


@contextlib.contextmanager
def module_loads_safely(module):
    """Inside the block, ``torch.load`` called by ``module``'s code (e.g. SAT's ``sat.training.model_io``, whose
    ZeRO-3 path loads with no ``weights_only``: in full on torch < 2.6 or with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``)
    goes through :func:`load`."""
    real = module.torch
    module.torch = _TorchWithSafeLoad(real)
    try:
        yield
    finally:
        module.torch = real
