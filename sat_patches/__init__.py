"""sat_patches: make multi-GPU (and CPU) fine-tuning of CogVLM/CogAgent on SwissArmyTransformer work.

``import sat_patches`` applies every patch once: at once when SAT is already imported, else the moment SAT is
imported (so importing sat_patches alone, as its command-line tools do, costs no SAT start-up), through the one
import hook of :mod:`sat_patches.core.import_hook`, which also serves the CUDA-only modules' stand-ins where they
are absent (without triton, ``import sat`` needs sat_patches imported first). Per patch opt-out:
``SAT_PATCHES_DISABLE=name1,name2``; ``SAT_PATCHES_FORCE=1`` applies patches whose SAT code does not look as
verified. :func:`status` tells what was applied (applying first if SAT was not imported yet), :func:`unpatch`
restores the originals. The package layout: README, "How it is built".
"""
from __future__ import annotations

import sys
from typing import Iterable, List

from .core import noise, settings
from .core.import_hook import HOOK, serve_standins
from .core.registry import REGISTRY, Patch, SatPatchesWarning  # noqa: F401

__version__ = "0.2.0"

_auto = {"pending": True, "applying": False}


def _registered():
    """The registry with every patch declared: importing :mod:`sat_patches.patches` registers them, in
    its order (and imports SAT)."""
    from . import patches  # noqa: F401  (imports SAT: only when SAT is imported or a patch is asked about)
    return REGISTRY


def _apply_on_import() -> None:
    """Called once SAT is imported: the patches go on, once no module of ours is mid-import (their records import
    our modules, and one half-imported cannot be imported from)."""
    HOOK.when_own_imports_done(_applied)


def _applied():
    """The registry after the automatic apply, if that is still waiting for ``import sat``."""
    if _auto["pending"] and not _auto["applying"]:
        apply()
    return _registered()


def _stop_waiting() -> None:
    HOOK.forget("sat", _apply_on_import)
    HOOK.counting_own = False


def apply(disable: Iterable[str] = (), force: bool | None = None) -> List[dict]:
    """Apply every patch not yet applied (idempotent). Returns :func:`status`."""
    _auto["applying"] = True
    try:
        _registered().apply_all(disable=disable, force=force)
    finally:
        _auto.update(pending=False, applying=False)
    _stop_waiting()
    return REGISTRY.table()


def unpatch(*names: str) -> None:
    """Restore the originals of the named patches (all when none named), including rebound
    ``from x import y`` aliases; patches stacked over a named one on the same target stay applied."""
    _auto["pending"] = False  # an unpatch before ``import sat`` also means: do not patch it then
    _stop_waiting()
    if names:
        _registered().restore(names)
    else:
        _registered().unpatch_all()


def status() -> List[dict]:
    """One row per patch: name, target, status (applied/skipped/disabled/...), reason, answers."""
    return _applied().table()


def is_patched(name: str) -> bool:
    """True when patch ``name`` is in place on its target right now."""
    patch = _applied().get(name)
    return patch.status == "applied" and (patch.is_applied() or patch.current() is patch.replacement)


def names() -> List[str]:
    return _registered().names()


def format_status(rows=None) -> str:
    rows = status() if rows is None else rows
    width = max(len(r["name"]) for r in rows)
    twidth = max(len(r["target"]) for r in rows)
    lines = [f"{'patch'.ljust(width)}  {'status'.ljust(10)}  {'target'.ljust(twidth)}  reason"]
    for r in rows:
        lines.append(f"{r['name'].ljust(width)}  {r['status'].ljust(10)}  {r['target'].ljust(twidth)}  {r['reason']}")
    lines += ["", "Targets with several patches, innermost first (each wraps the ones above it):"]
    for target, stack in stacks().items():
        lines.append(f"  {target}")
        lines += [f"    {i}. {name}: {why}" for i, (name, why) in enumerate(stack, 1)]
    return "\n".join(lines)


def stacks():
    """The declared order of the patches on each shared target: ``{target: [(name, why), ...]}``."""
    from .patches import STACKS  # importing the patch modules imports SAT: only when asked
    return STACKS


# Applied in this order, each at ``import sat_patches``, for the reason given:
if not ({noise.PATCH_NAME, "all"} & settings.read("SAT_PATCHES_DISABLE")):
    noise.install()  # 1. before SAT imports bitsandbytes and DeepSpeed, which log at import
serve_standins()  # 2. before ``import sat``, which imports SAT's triton rotary module (no triton: the stand-in)
HOOK.counting_own = "sat" not in sys.modules  # 3. SAT imported from inside a module of ours waits for it
HOOK.after("sat", _apply_on_import)  # 4. the patches: now if SAT is imported, else when it is
HOOK.arm()
