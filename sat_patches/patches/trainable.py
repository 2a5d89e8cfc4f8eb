"""``SAT_PATCHES_TRAINABLE=lora``: only the LoRA adapters train, whatever the script leaves trainable.

SAT asks the model which parameters train (``model.disable_untrainable_params()``, called from
``setup_model_untrainable_params_and_optimizer``). CogVLM's finetune demos leave more than the
adapters on (CogVLM: the MLP of EVA layers 46-54, about 0.5 B parameters; CogAgent: the cross
encoder, both vision experts and the EVA tower), which is what costs 24 GB cards their fit. The
finetune scripts' ``TRAINABLE=lora`` sets this variable; ``TRAINABLE=demo`` (or unset) keeps the
script's own choice.
"""
from __future__ import annotations

from ..core.registry import Patch, delegate, expect_names
from ..runtime.trainable import setup_with_trainable_setting


PATCHES = [
    Patch("trainable_setting", "sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer",
          delegate(setup_with_trainable_setting),
          answers="CogVLM's finetune demos train far more than LoRA (EVA MLP layers 46-54; CogAgent's cross "
                          "encoder, vision experts, EVA); SAT_PATCHES_TRAINABLE=lora trains the adapters only",
          expect=expect_names("disable_untrainable_params")),
]
