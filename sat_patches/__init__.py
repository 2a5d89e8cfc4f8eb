"""sat_patches: make multi-GPU (and CPU) fine-tuning of CogVLM/CogAgent on SwissArmyTransformer work.

``import sat_patches`` (before or after ``import sat``) applies every patch once. Per patch opt-out:
``SAT_PATCHES_DISABLE=name1,name2``; ``SAT_PATCHES_FORCE=1`` applies patches whose SAT code does
not look as verified. :func:`status` tells what was applied, :func:`unpatch` restores the originals.
"""
from __future__ import annotations

from typing import Iterable, List

from .core.registry import REGISTRY, Patch, SatPatchesWarning
from .patches import PATCHES

__version__ = "0.1.0"

REGISTRY.add(*PATCHES)  # in the order sat_patches.patches gives, innermost first


def apply(disable: Iterable[str] = (), force: bool | None = None) -> List[dict]:
    """Apply every patch not yet applied (idempotent). Returns :func:`status`."""
    REGISTRY.apply_all(disable=disable, force=force)
    return status()


def unpatch(*names: str) -> None:
    """Restore the originals of the named patches (all when none named), including rebound
    ``from x import y`` aliases; patches stacked over a named one on the same target stay applied."""
    if names:
        REGISTRY.restore(names)
    else:
        REGISTRY.unpatch_all()


def status() -> List[dict]:
    """One row per patch: name, target, status (applied/skipped/disabled/...), reason, answers."""
    return REGISTRY.table()


def is_patched(name: str) -> bool:
    """True when patch ``name`` is in place on its target right now."""
    patch = REGISTRY.get(name)
    return patch.status == "applied" and (patch.is_applied() or patch.current() is patch.replacement)


def names() -> List[str]:
    return REGISTRY.names()


def format_status(rows=None) -> str:
    rows = status() if rows is None else rows
    width = max(len(r["name"]) for r in rows)
    twidth = max(len(r["target"]) for r in rows)
    lines = [f"{'patch'.ljust(width)}  {'status'.ljust(10)}  {'target'.ljust(twidth)}  reason"]
    for r in rows:
        lines.append(f"{r['name'].ljust(width)}  {r['status'].ljust(10)}  {r['target'].ljust(twidth)}  {r['reason']}")
    return "\n".join(lines)


apply()
