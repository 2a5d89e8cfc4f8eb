"""Start-up hook of sat_patches (run from ``sat_patches.pth``; imports nothing heavy).

Without triton, ``import sat`` fails in ``sat/model/position_embedding/triton_rotary.py`` before
any code of ours could run. This finder serves that one module from sat_patches' pure-torch kernel,
so ``import sat`` works before ``import sat_patches`` too. It does nothing when triton is
installed or ``SAT_PATCHES_DISABLE`` names ``triton_rotary_import``.
"""
import importlib.abc
import importlib.util
import os
import sys

TRITON_ROTARY = "sat.model.position_embedding.triton_rotary"
PATCH_NAME = "triton_rotary_import"


def kernel_path():
    spec = importlib.util.find_spec("sat_patches")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "patches", "rotary_kernel.py")


def wanted() -> bool:
    disabled = {n.strip() for n in os.environ.get("SAT_PATCHES_DISABLE", "").split(",")}
    return not ({PATCH_NAME, "all"} & disabled) and importlib.util.find_spec("triton") is None


def kernel_spec(name=TRITON_ROTARY):
    """A module spec that executes sat_patches/rotary_kernel.py under SAT's module name."""
    path = kernel_path()
    return importlib.util.spec_from_file_location(name, path) if path else None


class TritonRotaryFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRITON_ROTARY or not wanted():
            return None
        return kernel_spec(fullname)


def install():
    if not any(isinstance(f, TritonRotaryFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TritonRotaryFinder())


install()
