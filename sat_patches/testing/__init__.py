"""Test support: run code on several CPU ranks over gloo, and tiny SAT models."""
from .multirank import CPU_STANDINS, RankResult, free_port, run_ranks, run_script, stock_disable

__all__ = ["RankResult", "run_ranks", "run_script", "free_port", "CPU_STANDINS", "stock_disable",
           "patches_removed"]

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
