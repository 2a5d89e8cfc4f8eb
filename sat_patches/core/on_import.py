"""Patches of modules imported late, or never: a CogVLM fork's ``utils/models/mixin.py``. Importing it ourselves
would import whatever ``utils`` the process sees, so an :class:`OnImportPatch` is ``waiting`` until the import hook
sees its module's code run, and is applied then, through the same gate as every patch.
"""
from __future__ import annotations

import sys

from .import_hook import HOOK
from .registry import Patch


class OnImportPatch(Patch):
    @property
    def module_name(self) -> str:
        return self.target.partition(":")[0]

    def _owner_and_attr(self):
        if self.module_name not in sys.modules:  # never imported from here: see the module's docstring
            raise LookupError(f"{self.module_name} is not imported")
        return super()._owner_and_attr()

    def current(self):
        return super().current() if self.module_name in sys.modules else None

    def apply(self, force: bool = False, aliases=None) -> None:
        self._force = force
        if self.module_name not in sys.modules:
            self.status, self.reason = "waiting", f"applied when {self.module_name} is imported"
        HOOK.after(self.module_name, self._on_import)

    def _on_import(self) -> None:
        Patch.apply(self, force=getattr(self, "_force", False))

    def restore(self) -> None:
        HOOK.forget(self.module_name, self._on_import)
        if self.status == "waiting":
            self.status, self.reason = "restored", ""
        super().restore()
