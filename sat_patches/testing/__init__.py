"""Test support: run code on several CPU ranks over gloo, and tiny SAT models."""
from .multirank import RankResult, run_ranks, run_script, free_port, CPU_STANDINS, stock_disable

__all__ = ["RankResult", "run_ranks", "run_script", "free_port", "CPU_STANDINS", "stock_disable",
           "patches_removed"]

import contextlib


@contextlib.contextmanager
def patches_removed(*names):
    """Inside the block the named patches (all when none named) are undone; re-applied after."""
    import sat_patches
    from sat_patches._registry import REGISTRY
    chosen = [REGISTRY.get(n) for n in names] if names else list(REGISTRY.patches)
    # A patch registered later on the same target wraps a chosen one (Patch.restore cannot unwrap
    # it from underneath): it comes off too, and goes back on with the rest.
    first = {}
    for p in chosen:
        first[p.target] = min(first.get(p.target, len(REGISTRY.patches)), REGISTRY.patches.index(p))
    undo = [p for i, p in enumerate(REGISTRY.patches) if p in chosen or i > first.get(p.target, i)]
    for p in reversed(undo):
        p.restore()
    try:
        yield
    finally:
        sat_patches.apply()
