"""Run a function right after a module has been imported (a post-import hook).

``import sat_patches`` must not import SAT itself (SAT pulls in transformers, datasets and
bitsandbytes: seconds of start-up that the command-line tools and the finetune scripts' pre-launch
checks never need). So the patches go on at the moment SAT is imported: this finder sits in
``sys.meta_path`` until the named module is first imported, lets the normal finders locate it,
and calls ``callback()`` once the module's own code has run, before the importer sees the module
(:class:`BeforeImport`: just before that code runs; :class:`WhileImporting`: around it).
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

from _sat_patches_deferred import found_elsewhere


class AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback
        self._finding = False

    def watches(self, fullname: str) -> bool:
        return fullname == self.name

    def find_spec(self, fullname, path=None, target=None):
        if not self.watches(fullname) or self._finding:
            return None
        spec = found_elsewhere(self, fullname)  # the other finders' answer
        if spec is None:
            return None
        spec.loader.exec_module = self._around(spec.loader.exec_module, fullname)
        return spec

    def _around(self, run_module, fullname: str):
        """The loader's ``exec_module``, with this hook's call after the module's own code."""
        def exec_module(module):
            run_module(module)
            self.done(fullname)
        return exec_module

    def done(self, fullname: str) -> None:
        self.remove()
        self.callback()

    def arm(self) -> "AfterImport":
        """Call back now if the module is already imported, else once it is."""
        if self.name in sys.modules:
            self.callback()
            return self
        return self.watch()

    def watch(self) -> "AfterImport":
        """In ``sys.meta_path`` (once), watching the imports to come."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        return self

    def is_armed(self) -> bool:
        return self in sys.meta_path

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class AfterEachImport(AfterImport):
    """``callback(fullname)`` after each module of the package ``name`` has been imported, until removed."""

    def watches(self, fullname: str) -> bool:
        return fullname.startswith(self.name + ".")

    def done(self, fullname: str) -> None:
        self.callback(fullname)

    def arm(self) -> "AfterEachImport":
        return self.watch()


class BeforeImport(AfterImport):
    """``callback()`` just before the module ``name``'s own code runs, at each import of it, until removed;
    ``calls`` counts them."""
    calls = 0

    def _around(self, run_module, fullname: str):
        def exec_module(module):
            self.calls += 1
            self.callback()
            run_module(module)
        return exec_module

    def arm(self) -> "BeforeImport":
        """Watch the module's next imports (one imported already has run its code: nothing to call)."""
        return self.watch()


class WhileImporting(BeforeImport):
    """The module ``name``'s own code runs inside ``callback()`` (a context manager), at each import of it, until
    removed; ``calls`` counts them."""

    def _around(self, run_module, fullname: str):
        def exec_module(module):
            self.calls += 1
            with self.callback():
                run_module(module)
        return exec_module


def initializing(package: str, but: str = "") -> list:
    """The modules of ``package`` whose own code is running now (mid-import), ``but`` left out."""
    return [name for name, module in list(sys.modules.items())
            if name.startswith(package + ".") and name != but
            and getattr(getattr(module, "__spec__", None), "_initializing", False)]

