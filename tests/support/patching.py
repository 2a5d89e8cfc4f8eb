"""Patches undone for the length of a block, in the test's own process."""
import contextlib

import sat_patches
from sat_patches.core.registry import REGISTRY


@contextlib.contextmanager
def patches_removed(*names):
    """Inside the block the named patches (all when none named) are undone; re-applied after."""
    if names:
        REGISTRY.restore(names)
    else:
        REGISTRY.unpatch_all()
    try:
        yield
    finally:
        sat_patches.apply()
