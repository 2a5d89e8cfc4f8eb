"""Registry entries that replace no function: modules served from stand-ins, and third-party log filters."""
from __future__ import annotations

import sys

from . import noise
from .import_hook import HOOK, STANDINS
from .registry import MARKER, Patch


class ServedModulePatch(Patch):
    """The module ``sys.modules:<name>`` served from its stand-in by the import hook, unless the real one is
    installed; listed, disable-able, restorable."""

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
        elif not HOOK.serve(self.module_name):
            self.status, self.reason = "not needed", f"{STANDINS[self.module_name][1]} is installed"
        elif self.current() is not None:  # the real module was imported before sat_patches
            HOOK.stop_serving(self.module_name)
            self.status, self.reason = "not needed", f"{self.module_name} is already imported"
        else:
            self.status, self.reason = "applied", "served when imported"

    def restore(self) -> None:
        if self.status != "applied":
            return
        HOOK.stop_serving(self.module_name)
        if self.is_applied():
            for name in [n for n in sys.modules if n == self.module_name or n.startswith(self.module_name + ".")]:
                del sys.modules[name]
            parent_name, _, leaf = self.module_name.rpartition(".")
            parent = sys.modules.get(parent_name) if parent_name else None
            if parent is not None and hasattr(parent, leaf):
                delattr(parent, leaf)
        self.status, self.reason = "restored", ""


class QuietThirdPartyPatch(Patch):
    """The log filters of :mod:`sat_patches.core.noise` as a registry entry."""

    def is_applied(self) -> bool:
        return noise.is_installed()

    current = is_applied

    def apply(self, force: bool = False, aliases=None) -> None:  # (binds no function: no aliases to rebind)
        noise.install()
        self.status, self.reason = "applied", ""

    def restore(self) -> None:
        if self.status == "applied":
            noise.remove()
            self.status, self.reason = "restored", ""
