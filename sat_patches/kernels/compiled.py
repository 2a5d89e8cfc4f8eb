"""Regional ``torch.compile`` of the bodies a transformer layer runs, one compiled function shared by every layer.

A body takes the layer's modules and the routing as arguments (looked up eagerly, outside the graph), so every
layer runs the same graph with its own parameters: no recompilation per layer (torchtune's regional compilation).
Inside a checkpointed layer the compiled body runs under the eager checkpoint. Off unless
``SAT_PATCHES_COMPILE_LAYERS=1``: no card has measured it faster yet; the eager body is the tested fallback.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from ..core import settings

_compiled: Dict[Callable, Callable] = {}


def layer_body(body: Callable) -> Callable:
    """``body`` compiled (once, then shared) when ``SAT_PATCHES_COMPILE_LAYERS=1``, else ``body`` itself."""
    if not settings.read("SAT_PATCHES_COMPILE_LAYERS"):
        return body
    if body not in _compiled:
        _compiled[body] = torch.compile(body)
    return _compiled[body]
