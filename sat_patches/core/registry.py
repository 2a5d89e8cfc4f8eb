"""The patch registry: one small record per patch, applied once, reversible (as Liger-Kernel's ``monkey_patch``
and ``gevent.monkey``). A replacement is marked (``__sat_patches__``, ``__wrapped__``) and every ``from x import
y`` alias it rebound is recorded, so :func:`unpatch_all` puts each one back.
"""
from __future__ import annotations

import functools
import gc
import importlib
import inspect
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple
from . import settings

MARKER = "__sat_patches__"
VERIFIED_SAT = "0.4.12"  # the SwissArmyTransformer release every patch's gate was written against
IN_ORDER = ("applied", "not needed", "disabled", "waiting")  # statuses that are no fault


class SatPatchesWarning(UserWarning):
    """A patch was skipped (SAT's code does not look as verified) or a setting was corrected."""


def code_names(obj) -> set:
    """Global/attribute names a function's code refers to (used to recognise SAT's code shape)."""
    obj = getattr(obj, "__func__", obj)
    code = getattr(obj, "__code__", None)
    if code is None:
        return set()
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and comprehensions
        if inspect.iscode(const):
            names |= set(const.co_names)
    return names


def expect_names(*names: str) -> Callable[[Any], Optional[str]]:
    """Gate: the original's code must refer to every one of ``names``."""
    def check(original):
        missing = [n for n in names if n not in code_names(original)]
        return f"its code no longer refers to {', '.join(missing)}" if missing else None
    return check


def expect_params(*params: str) -> Callable[[Any], Optional[str]]:
    """Gate: the original callable must accept every one of ``params``."""
    def check(original):
        try:
            have = inspect.signature(getattr(original, "__func__", original)).parameters
        except (TypeError, ValueError):
            return "its signature cannot be read"
        missing = [p for p in params if p not in have]
        return f"its signature lacks {', '.join(missing)}" if missing else None
    return check


def delegate(func: Callable, with_original: bool = True) -> Callable[[Any], Any]:
    """A patch's ``make``: a wrapper named as the original that returns ``func(original, *args, **kwargs)``
    (``with_original=False``: ``func(*args, **kwargs)``)."""
    def make(original):
        def replacement(*args, **kwargs):
            return func(original, *args, **kwargs) if with_original else func(*args, **kwargs)
        return functools.wraps(original)(replacement)
    return make


@dataclass
class Patch:
    """Replace ``target`` (``"pkg.module:Attr.path"``) with ``make(original)``."""

    name: str
    target: str
    make: Callable[[Any], Any]
    answers: str
    verified_on: str = f"SwissArmyTransformer {VERIFIED_SAT}"
    expect: Optional[Callable[[Any], Optional[str]]] = None
    # state
    status: str = "pending"
    reason: str = ""
    original: Any = None
    replacement: Any = None
    rebound: List[Tuple[dict, str]] = field(default_factory=list, repr=False)

    # -- target resolution -------------------------------------------------------------
    def _owner_and_attr(self):
        module_name, _, path = self.target.partition(":")
        owner = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        return owner, attr

    @staticmethod
    def _raw(owner, attr):
        # classes: take the raw descriptor (staticmethod/classmethod) from the class dict
        if inspect.isclass(owner) and attr in vars(owner):
            return vars(owner)[attr]
        return getattr(owner, attr)

    def current(self):
        owner, attr = self._owner_and_attr()
        return self._raw(owner, attr)

    def is_applied(self) -> bool:
        """True when this patch's replacement is on the target (possibly wrapped by a later patch)."""
        try:
            obj = self.current()
        except Exception:
            return False
        while obj is not None:
            if obj is self.replacement or getattr(obj, MARKER, None) == self.name:
                return True
            obj = getattr(getattr(obj, "__func__", obj), "__wrapped__", None)
        return False

    # -- apply / restore ---------------------------------------------------------------
    def apply(self, force: bool = False, aliases: Optional[Aliases] = None) -> None:
        try:
            owner, attr = self._owner_and_attr()
            current = self._raw(owner, attr)
        except Exception as exc:  # target module missing (e.g. DeepSpeed not installed)
            self.status, self.reason = "skipped", f"target not importable: {exc}"
            return
        if self.is_applied():
            self.status, self.reason = "applied", ""
            return
        # gate on SAT's own code, under any patch applied before this one
        problem = self.expect(_innermost(current)) if self.expect else None
        if problem and not force:
            self.status = "skipped"
            self.reason = f"{self.target} differs from {self.verified_on}: {problem}"
            warnings.warn(f"sat_patches: skipping patch '{self.name}': {self.reason} "
                          f"(set SAT_PATCHES_FORCE=1 to apply anyway)", SatPatchesWarning, stacklevel=3)
            return
        replacement = self.make(current)
        _mark(replacement, self.name, current)
        setattr(owner, attr, replacement)
        self.original, self.replacement = current, replacement
        self.rebound = (aliases or Aliases()).rebind(current, replacement, self.target.partition(":")[0])
        self.status, self.reason = "applied", ("forced: " + problem) if problem else ""

    def restore(self) -> None:
        """Put the original back. A later patch wrapping this one must come off first
        (:meth:`Registry.restore` orders that)."""
        if self.status != "applied" or self.replacement is None:
            return
        owner, attr = self._owner_and_attr()
        top = self._raw(owner, attr)
        if top is not self.replacement and self.is_applied():
            raise RuntimeError(f"cannot restore '{self.name}': patch '{getattr(top, MARKER, '?')}' wraps it; "
                               f"use sat_patches.unpatch('{self.name}'), which takes that one off first")
        if top is self.replacement:
            setattr(owner, attr, self.original)
        for namespace, name in self.rebound:
            if namespace.get(name) is self.replacement:
                namespace[name] = self.original
        self.rebound, self.replacement = [], None
        self.status, self.reason = "restored", ""


def _innermost(obj):
    func = getattr(obj, "__func__", obj)
    return inspect.unwrap(func) if callable(func) else obj


def _mark(obj, name, original):
    target = getattr(obj, "__func__", obj)  # staticmethod/classmethod: mark the function too
    for o in {id(obj): obj, id(target): target}.values():
        try:
            setattr(o, MARKER, name)
            if not hasattr(o, "__wrapped__"):
                setattr(o, "__wrapped__", getattr(original, "__func__", original))
        except (AttributeError, TypeError):
            pass


class Aliases:
    """Where each object is bound in the modules of SAT, of a patch's target package and of this package, so
    that ``from x import y`` aliases of a patched function can be rebound; one index serves a whole apply."""

    def __init__(self):
        self._where: Dict[int, List[Tuple[dict, str]]] = {}   # id(object) -> [(namespace, name)]
        self._seen: set = set()
        self._roots: set = set()
        self._modules = -1   # len(sys.modules) at the last pass: no new modules, no new pass

    def _index(self, roots) -> None:
        if len(sys.modules) == self._modules and roots <= self._roots:
            return
        self._modules, self._roots = len(sys.modules), self._roots | roots
        collecting = gc.isenabled()
        gc.disable()  # the index is ~10^5 small tuples: no collections over torch's heap while building it
        try:
            for mod_name, module in list(sys.modules.items()):
                if module is None or mod_name in self._seen:
                    continue
                if mod_name.partition(".")[0] not in self._roots and mod_name != "__main__":
                    continue
                self._seen.add(mod_name)
                for name, value in list(getattr(module, "__dict__", {}).items()):
                    self._where.setdefault(id(value), []).append((module.__dict__, name))
        finally:
            if collecting:
                gc.enable()

    def rebind(self, original, replacement, target_module: str) -> List[Tuple[dict, str]]:
        """Every alias of ``original`` now names ``replacement``; returns where (for :meth:`Patch.restore`)."""
        self._index({"sat", target_module.partition(".")[0], __name__.partition(".")[0]})
        rebound = [(namespace, name) for namespace, name in self._where.pop(id(original), [])
                   if namespace.get(name) is original]  # (entries since rebound to something else drop out)
        for namespace, name in rebound:
            namespace[name] = replacement
        self._where.setdefault(id(replacement), []).extend(rebound)
        return rebound


class Registry:
    """The ordered set of patches; see :func:`sat_patches.apply`. Where several patches share a target,
    their order is the one declared for that target (:meth:`declare_stacks`), not their registration order."""

    def __init__(self):
        self.patches: List[Patch] = []
        self.stacks: Dict[str, List[str]] = {}

    def add(self, *patches: Patch) -> None:
        known = {p.name for p in self.patches}
        for p in patches:
            if p.name in known:
                raise ValueError(f"duplicate patch name {p.name}")
            known.add(p.name)
            self.patches.append(p)

    def declare_stacks(self, stacks: Dict[str, List[str]]) -> None:
        """Declare, for each target several patches share, the order of exactly those patches (innermost first)."""
        by_target: Dict[str, List[str]] = {}
        for p in self.patches:
            by_target.setdefault(p.target, []).append(p.name)
        for target, names in by_target.items():
            declared = list(stacks.get(target, ()))
            if len(names) > 1 and sorted(declared) != sorted(names):
                raise ValueError(f"patches {names} share {target}: declare their order (innermost first) with "
                                 f"all of them; declared: {declared}")
        stray = set(stacks) - {t for t, n in by_target.items() if len(n) > 1}
        if stray:
            raise ValueError(f"stacks declared for targets without several patches: {sorted(stray)}")
        self.stacks = {t: list(n) for t, n in stacks.items()}
        # the declared order becomes the registration order on each shared target
        slots = {t: iter(self.get(n) for n in order) for t, order in self.stacks.items()}
        self.patches = [next(slots[p.target]) if p.target in slots else p for p in self.patches]

    def get(self, name: str) -> Patch:
        for p in self.patches:
            if p.name == name:
                return p
        raise KeyError(f"no patch named {name!r}; known: {', '.join(self.names())}")

    def names(self) -> List[str]:
        return [p.name for p in self.patches]

    def apply_all(self, disable=(), force=None) -> None:
        disabled = set(disable) | settings.read("SAT_PATCHES_DISABLE")
        unknown = disabled - set(self.names()) - {"all"}
        if unknown:
            warnings.warn(f"sat_patches: SAT_PATCHES_DISABLE names unknown patches {sorted(unknown)}; "
                          f"known: {', '.join(self.names())}", SatPatchesWarning, stacklevel=3)
        if force is None:
            force = settings.read("SAT_PATCHES_FORCE")
        aliases = Aliases()
        for i, p in enumerate(self.patches):
            if p.name in disabled or "all" in disabled:
                if p.status != "applied":
                    p.status, p.reason = "disabled", "SAT_PATCHES_DISABLE"
                continue
            if not p.is_applied():  # keep registration order on a shared target: later ones go on top
                for later in reversed(self.patches[i + 1:]):
                    if later.target == p.target and later.status == "applied":
                        later.restore()
                        aliases = Aliases()  # restoring rebinds aliases behind the index's back
            p.apply(force=force, aliases=aliases)

    def unpatch_all(self) -> None:
        for p in reversed(self.patches):
            p.restore()

    def restore(self, names) -> List[Patch]:
        """Restore the named patches (later ones on the same target come off first and go back on after)."""
        chosen = [self.get(n) for n in names]
        first = {}
        for p in chosen:
            first[p.target] = min(first.get(p.target, len(self.patches)), self.patches.index(p))
        undo = [p for i, p in enumerate(self.patches) if p in chosen or i > first.get(p.target, i)]
        for p in reversed(undo):
            p.restore()
        for p in undo:
            if p not in chosen:
                p.apply()
        return chosen

    def table(self) -> List[dict]:
        return [dict(name=p.name, target=p.target, status=p.status, reason=p.reason,
                     answers=p.answers, verified_on=p.verified_on) for p in self.patches]


REGISTRY = Registry()
