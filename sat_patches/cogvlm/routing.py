"""Routing tokens to CogVLM's language or vision expert without boolean-mask gathers.

Upstream indexes with the boolean ``vision_expert_mask`` three times per layer (a host sync and
gather/scatter kernels each). Here the mask is read once per step (:data:`expert_routing`) into an
:class:`ExpertRouting`: ``mixed`` (the order that puts every vision token before every language token, and its
inverse, made once as index tensors) or ``language``/``vision`` (every token to one expert). A mixed layer gathers
its tokens into that order once, gives each expert its rows as one contiguous ``[tokens, features]`` matrix (as
upstream's boolean gathers do), and puts the two results back in place with one more gather. Each token goes through
the same expert as upstream's code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..runtime.tensor_memo import TensorMemo


@dataclass(frozen=True, eq=False)
class ExpertRouting:
    """Which tokens of a ``[batch, tokens]`` mask go to the vision expert."""

    kind: str  # "language", "vision" or "mixed"
    order: Optional[torch.Tensor] = None  # mixed: flat positions (row * tokens + column), the vision tokens' first
    inverse: Optional[torch.Tensor] = None  # mixed: where each flat position is in ``order``
    vision_tokens: int = 0

    @classmethod
    def of_mask(cls, mask: torch.Tensor) -> "ExpertRouting":
        """Read the mask (one copy to the host) and make the routing for it."""
        where = mask.detach().bool().cpu()
        if where.dim() != 2:
            raise ValueError(f"vision_expert_mask must be [batch, tokens], got shape {tuple(mask.shape)}")
        if not bool(where.any()):
            return cls("language")
        if bool(where.all()):
            return cls("vision")
        flat = where.flatten()
        order = torch.cat([flat.nonzero().flatten(), (~flat).nonzero().flatten()])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return cls("mixed", order=order.to(mask.device), inverse=inverse.to(mask.device),
                   vision_tokens=int(flat.sum()))

    def apply(self, x: torch.Tensor, language: Callable, vision: Callable) -> torch.Tensor:
        """``language`` on the language tokens of ``x`` (``[batch, tokens, features]``), ``vision`` on the
        others, put back in place; the result has ``language``'s dtype. In a mixed batch each expert is given
        its tokens as one ``[tokens, features]`` matrix."""
        if self.kind == "language":
            return language(x)
        if self.kind == "vision":
            return vision(x)
        flat = x.reshape(-1, x.shape[-1])
        vis_in, lang_in = flat.index_select(0, self.order).split(
            [self.vision_tokens, flat.shape[0] - self.vision_tokens])
        lang = language(lang_in)
        vis = vision(vis_in).to(lang.dtype)
        out = torch.cat([vis, lang]).index_select(0, self.inverse)
        return out.view(*x.shape[:-1], lang.shape[-1])


expert_routing = TensorMemo(ExpertRouting.of_mask)
"""The routing of a ``vision_expert_mask``, read once per mask (see :mod:`sat_patches.runtime.tensor_memo`)."""

