"""Start-up hook of sat_patches (run from ``sat_patches.pth``; imports nothing heavy).

Two modules that SAT and CogVLM import exist only where CUDA does. This finder serves stand-ins
written in plain torch, so that ``import sat`` (and CogVLM's model code) work before
``import sat_patches`` too, on a machine without them:

* ``sat.model.position_embedding.triton_rotary`` imports ``triton`` at module level, so ``import
  sat`` fails without triton: served from ``sat_patches/kernels/rotary.py`` (patch
  ``triton_rotary_import``) when triton is not installed. Only SAT's module is substituted: a fake
  top-level ``triton`` would break ``torch._inductor``.
* ``xformers`` (CUDA wheels only): CogVLM's EVA2-CLIP attention calls
  ``xformers.ops.memory_efficient_attention``; served from ``sat_patches/standins/xformers/``
  (patch ``xformers_standin``) when xformers is not installed.

Each does nothing when the real module is installed or ``SAT_PATCHES_DISABLE`` names its patch. The same hook
defers the libraries SAT imports at ``import sat`` and a fine-tune never uses (``_sat_patches_deferred``).
"""
import importlib.abc
import importlib.util
import os
import sys

import _sat_patches_deferred

TRITON_ROTARY = "sat.model.position_embedding.triton_rotary"
PATCH_NAME = "triton_rotary_import"
XFORMERS = "xformers"

# module served -> (patch name, the real module whose absence calls for it, stand-in file under sat_patches/)
STANDINS = {
    TRITON_ROTARY: (PATCH_NAME, "triton", ("kernels", "rotary.py")),
    XFORMERS: ("xformers_standin", "xformers", ("standins", "xformers", "__init__.py")),
}


def _package_dir():
    spec = importlib.util.find_spec("sat_patches")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def kernel_path(name=TRITON_ROTARY):
    root = _package_dir()
    return os.path.join(root, *STANDINS[name][2]) if root else None


def _installed(module: str) -> bool:
    """Whether a finder other than ours finds ``module`` (the real one is installed)."""
    for finder in sys.meta_path:
        if isinstance(finder, StandInFinder) or not hasattr(finder, "find_spec"):
            continue
        try:
            if finder.find_spec(module, None) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def wanted(name=TRITON_ROTARY) -> bool:
    patch, real, _ = STANDINS[name]
    disabled = {n.strip() for n in os.environ.get("SAT_PATCHES_DISABLE", "").split(",")}
    return not ({patch, "all"} & disabled) and not _installed(real)


def kernel_spec(name=TRITON_ROTARY):
    """A module spec that executes the stand-in file under the served module's name."""
    path = kernel_path(name)
    if not path:
        return None
    if os.path.basename(path) == "__init__.py":  # a package: its submodules are found beside it
        return importlib.util.spec_from_file_location(name, path, submodule_search_locations=[os.path.dirname(path)])
    return importlib.util.spec_from_file_location(name, path)


class StandInFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in STANDINS or not wanted(fullname):
            return None
        return kernel_spec(fullname)




def install():
    if not any(isinstance(f, StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder())
    _sat_patches_deferred.install()  # libraries SAT imports at `import sat` and a fine-tune never uses


install()
