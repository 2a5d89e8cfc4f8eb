"""Pure-torch rotary kernel with the contract of SAT's triton ``apply_rotary``.

Standalone on purpose (torch only, no package-relative imports): the import hook
(:mod:`sat_patches.core.import_hook`) serves this file as ``sat.model.position_embedding.triton_rotary`` when
triton is missing, while ``sat`` itself is still being imported.

Every layer rotates its queries and keys (and, backward, their gradients) at the same positions with the same
cos/sin cache: those rows are gathered once per batch (:class:`RotaryTables`), not in every call. The rotation of
the halves ``(x0, x1)`` is ``x * [c, c] + [x1, x0] * [-s, s]``: per element the products and the sum of
``(x0 * c - x1 * s, x0 * s + x1 * c)``, in the same dtype, so the values are the same.
"""
import weakref
from typing import Optional, Union

import torch

__sat_patches__ = "triton_rotary_import"


class RotaryTables:
    """``(cos, sin)`` gathered at a batch's positions, as the non-interleaved rotation uses them: ``[c, c]`` and
    ``[-s, s]`` (``[s, -s]`` to undo it), ``(batch, 1, seqlen, rotary_dim)``. Kept per ``position_ids`` storage
    (weakly, as long as its values, its view and the cache tensors are the same)."""

    def __init__(self):
        self._entries: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.computed = 0

    def __call__(self, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor,
                 seqlen_offsets: Union[int, torch.Tensor], conjugate: bool):
        if isinstance(seqlen_offsets, torch.Tensor):  # (inference with a cache: not worth keeping)
            return self._gather(cos, sin, position_ids, seqlen_offsets, conjugate)
        key = (position_ids.storage_offset(), tuple(position_ids.shape), tuple(position_ids.stride()),
               position_ids._version, seqlen_offsets)
        by_direction = self._entries.setdefault(position_ids.untyped_storage(), {})
        entry = by_direction.get(conjugate)
        if entry is None or entry[0] != key or entry[1] is not cos or entry[2] is not sin:
            entry = by_direction[conjugate] = (key, cos, sin,
                                               self._gather(cos, sin, position_ids, seqlen_offsets, conjugate))
        return entry[3]

    def _gather(self, cos, sin, position_ids, seqlen_offsets, conjugate):
        self.computed += 1
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, whatever mode the first call ran in
            pos = position_ids.long()
            if isinstance(seqlen_offsets, torch.Tensor):
                pos = pos + seqlen_offsets.long().view(-1, 1)
            elif seqlen_offsets:
                pos = pos + seqlen_offsets
            c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # (batch, 1, seqlen, half)
            if conjugate:
                s = -s
            return torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)


rotary_tables = RotaryTables()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor,
                 seqlen_offsets: Union[int, torch.Tensor] = 0, cu_seqlens: Optional[torch.Tensor] = None,
                 max_seqlen: Optional[int] = None, interleaved: bool = False, inplace: bool = False,
                 conjugate: bool = False) -> torch.Tensor:
    """Same contract as SAT's triton ``apply_rotary``: x is (batch, nheads, seqlen, headdim),
    cos/sin are (seqlen_ro, rotary_dim/2) indexed by ``position_ids`` (batch, seqlen) plus offsets."""
    if cu_seqlens is not None:
        raise NotImplementedError("sat_patches rotary fallback: variable-length (cu_seqlens) input "
                                  "needs SAT's triton kernel on CUDA")
    batch, _, seqlen, headdim = x.shape
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > headdim:
        raise ValueError(f"rotary_dim {rotary_dim} must be <= headdim {headdim}")
    rot = x if rotary_dim == headdim else x[..., :rotary_dim]
    if interleaved:
        out = _interleaved(rot, cos, sin, position_ids, seqlen_offsets, conjugate)
    else:
        cos_cos, minus_sin_sin = rotary_tables(cos, sin, position_ids, seqlen_offsets, conjugate)
        x0, x1 = rot.split(half, dim=-1)
        out = rot * cos_cos + torch.cat((x1, x0), dim=-1) * minus_sin_sin
    out = out.to(x.dtype)
    if inplace:
        # like the triton kernel, write the memory without an autograd record (x is often a view
        # from split(); SAT's autograd.Function owns the gradient)
        (x.data if rot is x else x.data[..., :rotary_dim]).copy_(out)
        return x
    if rotary_dim < headdim:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out


def _interleaved(rot, cos, sin, position_ids, seqlen_offsets, conjugate):
    """GPT-J's rotation of the pairs ``(x[2i], x[2i+1])``."""
    pos = position_ids.long()
    if isinstance(seqlen_offsets, torch.Tensor):
        pos = pos + seqlen_offsets.long().view(-1, 1)
    else:
        pos = pos + seqlen_offsets
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # (batch, 1, seqlen, half)
    if conjugate:
        s = -s
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


apply_rotary.__sat_patches_kernel__ = True
