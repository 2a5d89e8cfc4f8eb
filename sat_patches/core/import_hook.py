"""The one import hook of sat_patches, armed by ``import sat_patches``.

* Stand-ins: where the real module is absent (and not disabled), our file is served under the name of SAT's
  ``sat.model.position_embedding.triton_rotary`` (``kernels/rotary.py``) and of ``xformers`` (``standins/xformers/``).
* ``after(module, callback)``: ``callback()`` runs once the module's own code has run.
* While the patches wait for SAT, our own modules are counted as they import, so that SAT imported from inside
  one of them is patched once the outermost one is done.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Callable, Dict, List

from . import settings

PACKAGE = __name__.split(".")[0]
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRITON_ROTARY = "sat.model.position_embedding.triton_rotary"
XFORMERS = "xformers"
# served module -> (the registry's name for it, the real module whose absence calls for it, our file)
STANDINS = {
    TRITON_ROTARY: ("triton_rotary_import", "triton", os.path.join(HERE, "kernels", "rotary.py")),
    XFORMERS: ("xformers_standin", "xformers", os.path.join(HERE, "standins", "xformers", "__init__.py")),
}


class ImportHook(importlib.abc.MetaPathFinder):
    def __init__(self, package: str = PACKAGE):
        self.package = package                            # whose modules are counted while ``counting_own``
        self.serving: Dict[str, str] = {}                 # module name -> stand-in file
        self.waiting: Dict[str, List[Callable[[], None]]] = {}
        self.counting_own = False
        self.own_running = 0
        self.after_own: List[Callable[[], None]] = []     # run when no module of ours is mid-import
        self._finding = False

    # -- what is watched ------------------------------------------------------------------------------
    def serve(self, name: str) -> bool:
        """Serve the stand-in for ``name`` from now on, unless the real module is installed; whether it does."""
        if self.installed(STANDINS[name][1]):
            return False
        self.serving[name] = STANDINS[name][2]
        return True

    def stop_serving(self, name: str) -> None:
        self.serving.pop(name, None)

    def after(self, module: str, callback: Callable[[], None]) -> None:
        """``callback()`` after each later import of ``module`` (at once if it is imported already)."""
        self.waiting.setdefault(module, [])
        if callback not in self.waiting[module]:
            self.waiting[module].append(callback)
        if module in sys.modules:
            callback()

    def forget(self, module: str, callback: Callable[[], None]) -> None:
        if callback in self.waiting.get(module, ()):
            self.waiting[module].remove(callback)

    def when_own_imports_done(self, callback: Callable[[], None]) -> None:
        """``callback()`` now, or once the module of ours being imported (and any it is inside) is done."""
        if self.own_running:
            self.after_own.append(callback)
        else:
            callback()

    # -- the finder -----------------------------------------------------------------------------------
    def installed(self, module: str) -> bool:
        """Whether Python's other finders find ``module`` (the real one is installed)."""
        return self._found_elsewhere(module) is not None

    def _found_elsewhere(self, fullname: str):
        self._finding = True
        try:
            return importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self._finding = False

    def find_spec(self, fullname, path=None, target=None):
        if self._finding:
            return None
        if fullname in self.serving:
            where = self.serving[fullname]
            package = [os.path.dirname(where)] if os.path.basename(where) == "__init__.py" else None
            return importlib.util.spec_from_file_location(fullname, where, submodule_search_locations=package)
        own = self.counting_own and fullname.startswith(self.package + ".")
        if not (own or self.waiting.get(fullname)):
            return None
        spec = self._found_elsewhere(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Notifying(spec.loader, self, fullname, own)
        return spec

    def _ran(self, fullname: str, own: bool) -> None:
        if own:
            self.own_running -= 1
            if not self.own_running:
                callbacks, self.after_own = self.after_own, []
                for callback in callbacks:
                    callback()
        for callback in list(self.waiting.get(fullname, ())):
            callback()

    def arm(self) -> "ImportHook":
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        return self


class _Notifying(importlib.abc.Loader):
    """Python's own loader of a watched module, with the hook told when the module's code has run."""

    def __init__(self, loader, hook: ImportHook, fullname: str, own: bool):
        self.loader, self.hook, self.fullname, self.own = loader, hook, fullname, own

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        if self.own:
            self.hook.own_running += 1
        try:
            module.__loader__ = self.loader  # what reads the source later (inspect, linecache) asks the real one
            self.loader.exec_module(module)
        except BaseException:
            if self.own:
                self.hook.own_running -= 1
            raise
        self.hook._ran(self.fullname, self.own)

    def __getattr__(self, name):  # get_source, get_resource_reader, is_package, ...
        return getattr(self.loader, name)


HOOK = ImportHook()


def disabled(name: str) -> bool:
    return bool({name, "all"} & settings.read("SAT_PATCHES_DISABLE"))


def serve_standins() -> None:
    """Serve each stand-in that is not disabled and whose real module is absent."""
    for name, (patch, _, _) in STANDINS.items():
        if not disabled(patch):
            HOOK.serve(name)
