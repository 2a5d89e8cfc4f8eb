"""``SAT_PATCHES_TRAINABLE=lora``: only the LoRA adapters train, whatever the script leaves trainable.

SAT asks the model which parameters train (``model.disable_untrainable_params()``, called from
``setup_model_untrainable_params_and_optimizer``). CogVLM's finetune demos leave more than the
adapters on (CogVLM: the MLP of EVA layers 46-54, about 0.5 B parameters; CogAgent: the cross
encoder, both vision experts and the EVA tower), which is what costs 24 GB cards their fit. The
finetune scripts' ``TRAINABLE=lora`` sets this variable; ``TRAINABLE=demo`` (or unset) keeps the
script's own choice.
"""
from __future__ import annotations

import functools

from ..core.registry import Patch, expect_names
from ..runtime.trainable import adapters_only, setting


def _setup(original):
    @functools.wraps(original)
    def setup_model_untrainable_params_and_optimizer(args, model, config_params=None):
        if setting() == "lora":
            scripts_choice = getattr(model, "disable_untrainable_params", None)

            def disable_untrainable_params():
                if scripts_choice is not None:
                    scripts_choice()
                adapters_only(model)
            model.disable_untrainable_params = disable_untrainable_params  # what SAT calls next
        return original(args, model, config_params)
    return setup_model_untrainable_params_and_optimizer


PATCHES = [
    Patch("trainable_setting", "sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer",
          _setup, answers="CogVLM's finetune demos train far more than LoRA (EVA MLP layers 46-54; CogAgent's cross "
                          "encoder, vision experts, EVA); SAT_PATCHES_TRAINABLE=lora trains the adapters only",
          expect=expect_names("disable_untrainable_params")),
]
