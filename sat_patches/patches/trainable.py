"""``SAT_PATCHES_TRAINABLE=lora``: only the LoRA adapters train, whatever the script leaves trainable (CogVLM's
demos also train EVA layers, CogAgent's the cross encoder and vision experts, which costs 24 GB cards their fit).
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
