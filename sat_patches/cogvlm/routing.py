"""Routing tokens to CogVLM's language or vision expert without boolean-mask gathers.

Upstream indexes with the boolean ``vision_expert_mask`` three times per layer (a host sync and
gather/scatter kernels each). Here the mask is read once per step (:data:`expert_routing`) into an
:class:`ExpertRouting`: ``block`` (the vision tokens are one run of positions, the same in every row:
slices route it), ``index`` (any other layout: index tensors made once), or ``language``/``vision``
(every token to one expert). Each token goes through the same expert as upstream's code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..runtime.tensor_memo import TensorMemo


@dataclass(frozen=True, eq=False)
class ExpertRouting:
    """Which tokens of a ``[batch, tokens]`` mask go to the vision expert."""

    kind: str  # "language", "vision", "block" or "index"
    start: int = 0  # block: the vision tokens are positions [start, end) of every row
    end: int = 0
    language_index: Optional[torch.Tensor] = None  # index: flat positions (row * tokens + column)
    vision_index: Optional[torch.Tensor] = None

    @classmethod
    def of_mask(cls, mask: torch.Tensor) -> "ExpertRouting":
        """Read the mask (one copy to the host) and choose the cheapest routing that is exact for it."""
        where = mask.detach().bool().cpu()
        if where.dim() != 2:
            raise ValueError(f"vision_expert_mask must be [batch, tokens], got shape {tuple(mask.shape)}")
        if not bool(where.any()):
            return cls("language")
        if bool(where.all()):
            return cls("vision")
        positions = where[0].nonzero().flatten()
        if len(positions):
            start, end = int(positions[0]), int(positions[-1]) + 1
            if end - start == len(positions) and bool((where == where[0]).all()):
                return cls("block", start=start, end=end)
        flat = where.flatten()
        return cls("index", language_index=(~flat).nonzero().flatten().to(mask.device),
                   vision_index=flat.nonzero().flatten().to(mask.device))

    def apply(self, x: torch.Tensor, language: Callable, vision: Callable) -> torch.Tensor:
        """``language`` on the language tokens of ``x`` (``[batch, tokens, features]``), ``vision`` on the
        others, put back in place; the result has ``language``'s dtype."""
        if self.kind == "language":
            return language(x)
        if self.kind == "vision":
            return vision(x)
        if self.kind == "block":
            s, e = self.start, self.end
            lang = language(torch.cat([x[:, :s], x[:, e:]], dim=1))
            vis = vision(x[:, s:e]).to(lang.dtype)
            return torch.cat([lang[:, :s], vis, lang[:, s:]], dim=1)
        flat = x.reshape(-1, x.shape[-1])
        lang = language(flat.index_select(0, self.language_index))
        vis = vision(flat.index_select(0, self.vision_index)).to(lang.dtype)
        out = lang.new_empty(flat.shape[0], lang.shape[-1])
        out = out.index_copy(0, self.language_index, lang).index_copy(0, self.vision_index, vis)
        return out.view(*x.shape[:-1], lang.shape[-1])


expert_routing = TensorMemo(ExpertRouting.of_mask)
"""The routing of a ``vision_expert_mask``, read once per mask (see :mod:`sat_patches.runtime.tensor_memo`)."""

