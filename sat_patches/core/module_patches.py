"""Registry entries that replace no function: modules served from stand-ins, libraries imported when first used or
before a SAT module, and third-party log filters."""
from __future__ import annotations

import importlib.util
import sys

import _sat_patches_boot
import _sat_patches_deferred

from . import noise
from .after_import import BeforeImport
from .registry import MARKER, Patch

BITSANDBYTES_PATCH = "bitsandbytes_compile_on_first_call"


def _import_bitsandbytes_without_compiler() -> None:
    from ..lora.bitsandbytes_import import import_bitsandbytes  # (SAT is imported: lora2 is one of its modules)
    import_bitsandbytes()


# armed at ``import sat_patches``: any module may import SAT's LoRA first, ours included while the patches wait
BITSANDBYTES_BEFORE_LORA = BeforeImport("sat.model.finetune.lora2", _import_bitsandbytes_without_compiler)


class ServedModulePatch(Patch):
    """Provide the module ``sys.modules:<name>`` from its stand-in (an import-time patch).

    Usually the start-up hook has already served it; otherwise it is placed in ``sys.modules`` here,
    before anything imports it."""

    @property
    def module_name(self) -> str:
        return self.target.partition(":")[2]

    def current(self):
        return sys.modules.get(self.module_name)

    def is_applied(self) -> bool:
        return getattr(self.current(), MARKER, None) == self.name

    def apply(self, force: bool = False, aliases=None) -> None:  # (binds no function: no aliases to rebind)
        if self.is_applied():
            self.status, self.reason = "applied", ""
            return
        if not _sat_patches_boot.wanted(self.module_name):
            real = _sat_patches_boot.STANDINS[self.module_name][1]
            self.status, self.reason = "not needed", f"{real} is installed"
            return
        if self.current() is not None:  # only reachable when the real module imported before
            self.status, self.reason = "not needed", f"{self.module_name} is already imported"
            return
        spec = _sat_patches_boot.kernel_spec(self.module_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.module_name] = self.replacement = module
        spec.loader.exec_module(module)
        self.status, self.reason = "applied", ""

    def restore(self) -> None:
        if self.status == "applied" and self.current() is not None and self.is_applied():
            for name in [n for n in sys.modules if n == self.module_name or n.startswith(self.module_name + ".")]:
                del sys.modules[name]
            parent_name, _, leaf = self.module_name.rpartition(".")
            parent = sys.modules.get(parent_name) if parent_name else None
            if parent is not None and hasattr(parent, leaf):
                delattr(parent, leaf)
            self.replacement = None
            self.status, self.reason = "restored", ""


class QuietThirdPartyPatch(Patch):
    """The log filters of :mod:`sat_patches.core.noise` as a registry entry (they go on at ``import
    sat_patches``, before SAT imports the libraries that log; listed, restorable, disable-able here)."""

    def current(self):
        return noise.is_installed()

    def is_applied(self) -> bool:
        return self.current()

    def apply(self, force: bool = False, aliases=None) -> None:  # (binds no function: no aliases to rebind)
        noise.install()
        self.status, self.reason = "applied", ""

    def restore(self) -> None:
        if self.status == "applied":
            noise.remove()
            self.status, self.reason = "restored", ""


class DeferredImportsPatch(Patch):
    """The start-up hook's deferral of the libraries SAT imports at ``import sat`` and a fine-tune never uses
    (``_sat_patches_deferred``) as a registry entry: listed, disable-able (``SAT_PATCHES_DISABLE``, read when SAT
    is imported), restorable (later imports of SAT's modules import those libraries again)."""

    def current(self):
        return any(isinstance(f, _sat_patches_deferred.DeferringFinder) for f in sys.meta_path)

    def is_applied(self) -> bool:
        return self.current() and _sat_patches_deferred.wanted()

    def apply(self, force: bool = False, aliases=None) -> None:  # (binds no function: no aliases to rebind)
        _sat_patches_deferred.install()
        self.status, self.reason = "applied", ""

    def restore(self) -> None:
        if self.status == "applied":
            for finder in [f for f in sys.meta_path if isinstance(f, _sat_patches_deferred.DeferringFinder)]:
                sys.meta_path.remove(finder)
            self.status, self.reason = "restored", ""


class BeforeImportPatch(Patch):
    """A :class:`~sat_patches.core.after_import.BeforeImport` hook (``make``; a ``WhileImporting`` one too) as a
    registry entry: listed, disable-able (``SAT_PATCHES_DISABLE``), restorable; armed when applied (bitsandbytes'
    earlier, at ``import sat_patches``, where ``SAT_PATCHES_DISABLE`` is read for it)."""

    @property
    def hook(self) -> BeforeImport:
        return self.make

    def current(self):
        return self.hook.is_armed()

    def is_applied(self) -> bool:
        return self.current()

    def apply(self, force: bool = False, aliases=None) -> None:  # (binds no function: no aliases to rebind)
        self.hook.arm()
        if self.hook.name in sys.modules and not self.hook.calls:
            self.status, self.reason = "not needed", f"{self.hook.name} was imported before sat_patches"
        else:
            self.status, self.reason = "applied", ""

    def restore(self) -> None:
        self.hook.remove()
        if self.status in ("applied", "not needed"):
            self.status, self.reason = "restored", ""
