"""A third state of a checkpointed layer, between SAT's full checkpoint and none: selective checkpointing.

SAT's ``BaseTransformer.forward`` checkpoints each chunk of ``checkpoint_num_layers`` layers through the name
``checkpoint`` of ``sat.model.transformer`` (DeepSpeed's on CUDA, torch's otherwise), leaving its last
``checkpoint_skip_layers`` layers unchecked. A fully checkpointed layer keeps its input and runs its whole forward
again in the backward pass; a selective one runs under torch's non-reentrant checkpoint with
:func:`keep_matrix_products` as its policy: the outputs of the matrix products and of attention are kept, the
elementwise work (norms, activations, rotary, routing's copies) is recomputed, so the backward pass multiplies no
matrix twice. Random ops' outputs are kept too: SAT's model-parallel RNG tracker is not rewound by torch's checkpoint.

``SAT_PATCHES_CHECKPOINT_SELECTIVE`` is the share of each transformer's checkpointed layers that are selective (the
last ones before the unchecked layers); 0, the default, leaves SAT's checkpointing as it is.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch.utils import checkpoint as torch_checkpoint

from ..core import settings
from ..planning.timing import layer_states

SETTING = "SAT_PATCHES_CHECKPOINT_SELECTIVE"
_aten = torch.ops.aten
KEPT = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.native_dropout, _aten.bernoulli})
KEPT_PREFIX = "_scaled_dot_product"  # every attention kernel of F.scaled_dot_product_attention (flash, efficient, cpu)


def keep_matrix_products(ctx, op, *args, **kwargs) -> torch_checkpoint.CheckpointPolicy:
    """The selective policy: keep what matrix products, attention and random ops return; recompute the rest."""
    if op.overloadpacket in KEPT or op.overloadpacket.__name__.startswith(KEPT_PREFIX):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


SELECTIVE = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, keep_matrix_products)


def _chunk_of(function):
    """``(transformer, first layer)`` of the chunk SAT's ``custom_forward`` closure runs; None for another caller."""
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure))
    if "self" not in cells or "start" not in cells:
        return None
    return cells["self"].cell_contents, cells["start"].cell_contents


def is_selective(function) -> bool:
    share = settings.read(SETTING)
    chunk = _chunk_of(function) if share else None
    if chunk is None:
        return False
    transformer, start = chunk
    return layer_states(len(transformer.layers), transformer.checkpoint_skip_layers, share)[start] == "selective"


def checkpoint_chunk(sat_checkpoint, function, *args, **kwargs):
    """SAT's checkpoint of one chunk of layers, or torch's selective one where :func:`layer_states` says so."""
    if is_selective(function):
        if settings.read("SAT_PATCHES_COMPILE_LAYERS"):
            raise settings.SettingError(f"{SETTING} and SAT_PATCHES_COMPILE_LAYERS=1 do not combine (a selective "
                                        f"checkpoint finds its kept tensors changed by the compiled bodies): set "
                                        f"{SETTING}=0 or SAT_PATCHES_COMPILE_LAYERS=0")
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=SELECTIVE)
    return sat_checkpoint(function, *args, **kwargs)


def _codes(code):
    yield code
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _codes(const)


def expect_layer_chunks(original) -> str:
    """Gate: SAT's ``BaseTransformer.forward`` checkpoints a ``custom_forward`` closing over ``self`` and ``start``."""
    from sat.model.transformer import BaseTransformer  # read when the patch goes on: SAT is importable by then
    chunks = [c for c in _codes(BaseTransformer.forward.__code__) if c.co_name == "custom_forward"]
    if not chunks or not {"self", "start"} <= set(chunks[0].co_freevars):
        return "BaseTransformer.forward no longer checkpoints a custom_forward closing over self and start"
    return None
