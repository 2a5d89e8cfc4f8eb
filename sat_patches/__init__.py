"""sat_patches: make multi-GPU (and CPU) fine-tuning of CogVLM/CogAgent on SwissArmyTransformer work.

``import sat_patches`` (before or after ``import sat``) applies every patch once: at once when SAT is
already imported, else the moment SAT is imported (so importing sat_patches alone, as its
command-line tools do, costs no SAT start-up). Per patch opt-out: ``SAT_PATCHES_DISABLE=name1,name2``;
``SAT_PATCHES_FORCE=1`` applies patches whose SAT code does not look as verified. :func:`status`
tells what was applied (applying first if SAT was not imported yet), :func:`unpatch` restores the
originals.

Where things are: :mod:`sat_patches.patches` (the patch records, one module per SAT concern, and the order
of those that share a target), the libraries they bind (:mod:`sat_patches.runtime`, :mod:`sat_patches.checkpoints`,
:mod:`sat_patches.diagnostics`, :mod:`sat_patches.lora`, ...), :mod:`sat_patches.core` (the registry, the settings,
the model kinds), :mod:`sat_patches.cogvlm` (CogVLM/CogAgent models, trainer, evaluation), :mod:`sat_patches.cli`
(the ``sat-patches`` command, one module per verb), :mod:`sat_patches.runner` (what the finetune scripts run).
``python -m sat_patches.launch`` runs a script with the
patches armed; ``python -m sat_patches.merge``, ``.evaluate``, ``.finetune`` are ``sat-patches`` verbs.
"""
from __future__ import annotations

import sys
from typing import Iterable, List

import _sat_patches_boot  # noqa: F401  (without triton, ``import sat`` needs SAT's rotary module served)

from .core import module_patches, noise
from .core.after_import import AfterEachImport, AfterImport, initializing
from .core import settings
from .core.registry import REGISTRY, Patch, SatPatchesWarning  # noqa: F401

__version__ = "0.2.0"

_auto = {"pending": True, "applying": False, "waiting": False}


def _registered():
    """The registry with every patch declared: importing :mod:`sat_patches.patches` registers them, in
    its order (and imports SAT)."""
    from . import patches  # noqa: F401  (imports SAT: only when SAT is imported or a patch is asked about)
    return REGISTRY


def _apply_on_import(finished: str = "") -> None:
    """Called once SAT is imported. When SAT's import came from a patch module being imported,
    :mod:`sat_patches.patches` calls this again once all of them are. When it came from another module of
    ours mid-import (``from sat_patches.checkpoints.loading import ...`` before ``import sat``), the patches,
    which import that module, wait until it is done: called again as each module of ours finishes
    (``finished``)."""
    patches = sys.modules.get(f"{__name__}.patches")
    if patches is not None and not hasattr(patches, "PATCHES"):
        return
    if not _auto["pending"] or _auto["applying"]:
        return  # (every later status() and is_patched() call comes here: no scan of the modules)
    if initializing(__name__, but=finished):
        _auto["waiting"] = True
        return
    _auto["waiting"] = False
    apply()


def _after_own_import(fullname: str) -> None:
    if _auto["waiting"]:
        _apply_on_import(finished=fullname)


def _applied():
    """The registry after the automatic apply, if that is still waiting for ``import sat``."""
    _apply_on_import()
    return _registered()


def apply(disable: Iterable[str] = (), force: bool | None = None) -> List[dict]:
    """Apply every patch not yet applied (idempotent). Returns :func:`status`."""
    _auto["applying"] = True
    try:
        _registered().apply_all(disable=disable, force=force)
    finally:
        _auto.update(pending=False, applying=False, waiting=False)
    _hook.remove()
    _own_imports.remove()
    return REGISTRY.table()


def unpatch(*names: str) -> None:
    """Restore the originals of the named patches (all when none named), including rebound
    ``from x import y`` aliases; patches stacked over a named one on the same target stay applied."""
    _auto["pending"] = False  # an unpatch before ``import sat`` also means: do not patch it then
    _hook.remove()
    _own_imports.remove()
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


if not ({noise.PATCH_NAME, "all"} & settings.read("SAT_PATCHES_DISABLE")):
    noise.install()  # before SAT imports bitsandbytes and DeepSpeed, which log at import
if not ({module_patches.BITSANDBYTES_PATCH, "all"} & settings.read("SAT_PATCHES_DISABLE")):
    module_patches.BITSANDBYTES_BEFORE_LORA.arm()  # before anything imports SAT's LoRA, our own modules included
_own_imports = AfterEachImport(__name__, _after_own_import)  # where the patches wait for a module of ours
_hook = AfterImport("sat", _apply_on_import)
if "sat" not in sys.modules:
    _own_imports.arm()
_hook.arm()
