"""Checking stand-ins for the numpy globals a checkpoint may name (numpy's RNG state in SAT saves).

numpy's own ``dtype``/``ndarray``/``_reconstruct`` would restore any saved dtype state (an object dtype flagged
as holding no references makes numpy read file bytes as pointers). These build only dtypes of plain numbers and
arrays of them from a bytes buffer of exactly the size their shape needs; :func:`finish` swaps the built
objects in for the builders the unpickler left.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

PLAIN_KINDS = "biufc"  # bool, signed, unsigned, float, complex


class UnsafeNumpyError(ValueError):
    """A numpy object in a checkpoint that is not a plain numeric array or dtype."""


def _refuse(what: str):
    raise UnsafeNumpyError(f"a checkpoint holds {what}; only arrays of plain numbers (bool, integer, float, complex) "
                           f"are loaded from numpy objects. Not loaded")


def plain_dtype(spec, byteorder: str = "=") -> np.dtype:
    """The dtype of type code ``spec`` (a str such as ``'u4'``), refused unless it is a plain number."""
    if not isinstance(spec, str) or len(spec) > 8:
        _refuse(f"a numpy dtype given as {type(spec).__name__} {spec!r:.40}")
    try:
        dtype = np.dtype(spec)
    except TypeError:
        _refuse(f"an unknown numpy dtype {spec!r}")
    if dtype.kind not in PLAIN_KINDS or dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        _refuse(f"a numpy dtype {spec!r} (kind {dtype.kind!r})")
    if byteorder not in ("<", ">", "=", "|"):
        _refuse(f"a numpy dtype byte order {byteorder!r}")
    return dtype.newbyteorder(byteorder) if byteorder in "<>" else dtype


class DTypeBuilder:
    """Stands in for ``numpy.dtype``: ``numpy.dtype(spec, align, copy)`` then its saved state."""

    def __new__(cls, spec=None, align=False, copy=True, *rest):
        self = super().__new__(cls)
        self.spec, self.dtype = spec, None
        if rest or not isinstance(align, bool) or not isinstance(copy, bool):
            _refuse("a numpy dtype with unexpected arguments")
        return self

    def __setstate__(self, state):
        # numpy's dtype state: (version, byteorder, subarray, names, fields, elsize, alignment, flags[, metadata])
        if not isinstance(state, tuple) or len(state) not in (8, 9) or state[0] not in (3, 4):
            _refuse("a numpy dtype with an unknown saved state")
        version, byteorder, subarray, names, fields, elsize, alignment, flags = state[:8]
        if (subarray, names, fields) != (None, None, None) or (elsize, alignment, flags) != (-1, -1, 0) \
                or (len(state) == 9 and state[8] is not None):
            _refuse(f"a numpy dtype {self.spec!r} with saved fields, sizes or flags")
        self.dtype = plain_dtype(self.spec, byteorder)

    def built(self) -> np.dtype:
        if self.dtype is None:
            if self.spec is None:
                _refuse("an incomplete numpy dtype")
            self.dtype = plain_dtype(self.spec)  # numpy pickles without a state only the native order
        return self.dtype


class ArrayType:
    """Stands in for ``numpy.ndarray``: only the marker ``_reconstruct`` expects; never built."""

    def __new__(cls, *args, **kwargs):
        _refuse("a numpy array built directly (not from its bytes)")


class ArrayBuilder:
    """Stands in for numpy's ``_reconstruct(ndarray, (0,), b'b')`` then ``ndarray.__setstate__``."""

    def __new__(cls, subtype=None, shape=None, typecode=None, *rest):
        if not (isinstance(subtype, type) and issubclass(subtype, ArrayType)) or rest:
            _refuse(f"a numpy array of type {getattr(subtype, '__name__', subtype)!r:.60}")
        self = super().__new__(cls)
        self.array = None
        return self

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            _refuse("a numpy array with an unknown saved state")
        shape, dtype, fortran, data = state[-4:]
        if len(state) == 5 and state[0] != 1:
            _refuse("a numpy array with an unknown saved state version")
        if not isinstance(dtype, DTypeBuilder):
            _refuse(f"a numpy array whose dtype is a {type(dtype).__name__}")
        dtype = dtype.built()
        if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)) or len(shape) > 32:
            _refuse(f"a numpy array of shape {shape!r:.60}")
        if not isinstance(data, bytes) or not isinstance(fortran, bool):
            _refuse(f"a numpy array whose data is a {type(data).__name__}, not bytes")
        count = 1
        for n in shape:
            count *= n
        if count * dtype.itemsize != len(data):
            _refuse(f"a numpy array of shape {shape} {dtype} ({count * dtype.itemsize} bytes) with {len(data)} bytes")
        flat = np.frombuffer(bytearray(data), dtype=dtype)
        self.array = flat.reshape(shape, order="F" if fortran else "C")

    def built(self) -> np.ndarray:
        if self.array is None:
            _refuse("an incomplete numpy array")
        return self.array


def standins(names: Dict[str, type]) -> List[type]:
    """Each stand-in of ``{"numpy.dtype": DTypeBuilder, ...}`` under numpy's ``module.name`` (a subclass), as
    torch's unpickler matches allowed globals by name."""
    out = []
    for full, cls in names.items():
        module, _, name = full.rpartition(".")
        out.append(type(name, (cls,), {"__module__": module, "__qualname__": name}))
    return out


def _finish_one(obj, seen: Dict[int, Any]):
    if isinstance(obj, (DTypeBuilder, ArrayBuilder)):
        return obj.built()
    if isinstance(obj, (str, bytes, int, float, bool, type(None))) or hasattr(obj, "is_meta"):
        return obj  # tensors and plain values hold no numpy objects
    key = id(obj)
    if key in seen:
        return seen[key]
    if isinstance(obj, dict):
        seen[key] = obj
        for k, v in list(obj.items()):
            obj[k] = _finish_one(v, seen)
    elif isinstance(obj, list):
        seen[key] = obj
        obj[:] = [_finish_one(v, seen) for v in obj]
    elif isinstance(obj, tuple):
        done: Tuple = tuple(_finish_one(v, seen) for v in obj)
        if type(obj) is not tuple and hasattr(obj, "_fields"):  # a named tuple
            done = type(obj)(*done)
        elif type(obj) is not tuple:
            done = obj
        seen[key] = done
        return done
    elif isinstance(obj, (set, frozenset)):
        seen[key] = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        seen[key] = obj
        for k, v in list(vars(obj).items()):
            setattr(obj, k, _finish_one(v, seen))
    return seen.get(key, obj)


def finish(obj):
    """``obj`` (an unpickled checkpoint) with every builder replaced by the array or dtype it built."""
    return _finish_one(obj, {})

