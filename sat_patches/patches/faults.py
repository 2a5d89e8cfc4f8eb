"""Faults and bad input: dead ranks named (:mod:`sat_patches.diagnostics.heartbeat`), and LoRA/DeepSpeed arguments
that cannot work refused (:mod:`sat_patches.runtime.checks`)."""
from __future__ import annotations

import functools

from ..core.registry import Patch, delegate, expect_names, expect_params
from ..diagnostics.heartbeat import training_main_with_heartbeat
from ..runtime.checks import check_lora_args
from ..runtime.deepspeed_config import get_args_naming_bad_json


def _lora_mixin_init(original):
    """LoraMixin(layer_num, r, ..., layer_range, qlora): stock SAT divides by r and skips unknown layers
    (QLoRA without bitsandbytes: THUDM/CogVLM#257, THUDM/CogVLM#438, SAT's own "Build 4bit layer failed")."""
    @functools.wraps(original)
    def __init__(self, layer_num, r=0, *args, **kwargs):
        layer_range = kwargs.get("layer_range", args[2] if len(args) > 2 else None)
        qlora = kwargs.get("qlora", args[3] if len(args) > 3 else False)
        check_lora_args(r, layer_range, num_layers=layer_num, use_qlora=qlora)
        return original(self, layer_num, r, *args, **kwargs)
    return __init__


PATCHES = [
    Patch("lora_args_check", "sat.model.finetune.lora2:LoraMixin.__init__", _lora_mixin_init,
          answers="stock SAT divides by a LoRA rank of 0 and skips layers outside the model; THUDM/CogVLM#257, #438 "
                  "(QLoRA without bitsandbytes): LoRA rank <= 0, "
                  "layer_range outside the model, --use_qlora without bitsandbytes refused before LoRA layers are built",
          expect=expect_params("layer_num", "r", "layer_range", "qlora")),
    Patch("deepspeed_config_json", "sat.arguments:get_args", delegate(get_args_naming_bad_json),
          answers="stock SAT: a --deepspeed_config that is not valid JSON fails with a bare JSONDecodeError; now "
                  "the message names the file and line",
          expect=expect_names("json", "load", "deepspeed_config")),
    Patch("rank_heartbeat", "sat.training.deepspeed_training:training_main", delegate(training_main_with_heartbeat),
          answers="THUDM/CogVLM#283, #320 (kill -9; 'training stops with no clear error'): survivors of a "
                  "dead rank exit non-zero within SAT_PATCHES_HEARTBEAT_TIMEOUT naming it",
          expect=expect_names("train")),
]
