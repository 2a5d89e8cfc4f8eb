"""Patches of a CogVLM fork's own model code (``utils/models/mixin.py``, patched when the fork's demo imports
it): its vision-expert mixins' ``mlp_forward``/``attention_forward``, which route tokens with boolean masks
(host syncs each layer), become :func:`sat_patches.cogvlm.vision_expert.expert_mlp_forward` and
``expert_attention_forward``, which read the same attributes and compute the same values.
"""
from __future__ import annotations

from ..cogvlm.vision_expert import expert_attention_forward, expert_mlp_forward
from ..core.on_import import OnImportPatch
from ..core.registry import code_names, delegate

MIXINS = "utils.models.mixin"
VERIFIED_ON = "THUDM/CogVLM utils/models/mixin.py (f7283b2)"


def expect_code(*names: str):
    """Gate: the fork's method refers to each of ``names``, as an attribute or a string key of ``kw_args``."""
    def check(original):
        code = getattr(original, "__code__", None)
        strings = {c for c in getattr(code, "co_consts", ()) if isinstance(c, str)}
        missing = [n for n in names if n not in code_names(original) | strings]
        return f"its code no longer refers to {', '.join(missing)}" if missing else None
    return check


PATCHES = [
    OnImportPatch("fork_expert_routing_mlp", f"{MIXINS}:LlamaVisionExpertFCMixin.mlp_forward",
                  delegate(expert_mlp_forward, with_original=False),
                  answers="a fork's vision-expert MLP gathers tokens with boolean masks: host syncs per layer",
                  verified_on=VERIFIED_ON,
                  expect=expect_code("vision_expert_mask", "layer_id", "gate_proj", "vision_gate_proj",
                                     "vision_dense_h_to_4h_list", "vision_dense_4h_to_h_list", "vision_layer_range",
                                     "activation_func", "dense_h_to_4h", "dense_4h_to_h")),
    OnImportPatch("fork_expert_routing_attention", f"{MIXINS}:LlamaVisionExpertAttnMixin.attention_forward",
                  delegate(expert_attention_forward, with_original=False),
                  answers="a fork's vision-expert attention gathers tokens with boolean masks: host syncs per layer",
                  verified_on=VERIFIED_ON,
                  expect=expect_code("vision_expert_mask", "layer_id", "position_ids", "use_vision_expert",
                                     "vision_layer_range", "vision_query_key_value_list", "vision_dense_list",
                                     "rotary_emb", "query_key_value", "dense", "_transpose_for_scores",
                                     "hidden_size_per_partition")),
]
