"""The LLaMA language model under CogVLM without the mixins SAT's ``LLaMAModel`` adds and CogVLM deletes:
SAT's ``BaseModel.__init__`` with LLaMA's settings, plus the ``lm`` head built in the model's dtype/device."""
from __future__ import annotations

import torch.nn as nn

from sat.model.base_model import BaseMixin, BaseModel
from sat.mpu.layers import ColumnParallelLinear
from sat.mpu.utils import unscaled_init_method
from sat.ops.layernorm import RMSNorm

from .placement import Placement


class LMMixin(BaseMixin):
    """Output projection ``lm_head`` (vocab-parallel, gathered), as SAT's ``LMMixin``."""

    def __init__(self, vocab_size, hidden_size, placement: Placement):
        super().__init__()
        kwargs = placement.parallel_kwargs()
        kwargs["init_method"] = unscaled_init_method(0.02)  # SAT's LMMixin default
        self.lm_head = ColumnParallelLinear(hidden_size, vocab_size, gather_output=True, bias=False,
                                            module=self, name="lm_head", **kwargs)

    def final_forward(self, logits, **kwargs):
        return self.lm_head(logits)


def init_llama_base(model: BaseModel, args, transformer=None, params_dtype=None, parallel_output=None,
                    **kwargs) -> Placement:
    """Run ``BaseModel.__init__`` on ``model`` with LLaMA's settings and add the ``lm`` mixin.
    Returns the placement (dtype/device/init) the transformer was built with, for the other mixins."""
    if "inner_hidden_size" not in args:
        args.inner_hidden_size = None
    kwargs.setdefault("layernorm", RMSNorm)
    kwargs.setdefault("activation_func", nn.functional.silu)
    kwargs.setdefault("init_method_std", 0.01)
    if params_dtype is not None:
        kwargs["params_dtype"] = params_dtype
    BaseModel.__init__(model, args, transformer=transformer, **kwargs)
    if parallel_output is not None:  # older callers pass it; SAT >= 0.4.12 reads it from args
        model.transformer.parallel_output = parallel_output
    if not getattr(args, "is_rotary_emb", False) and hasattr(model.transformer, "position_embeddings"):
        del model.transformer.position_embeddings
    placement = Placement.of_transformer(model.transformer, getattr(args, "skip_init", False))
    model.add_mixin("lm", LMMixin(args.vocab_size, args.hidden_size, placement))
    return placement
