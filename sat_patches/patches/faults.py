"""Faults and bad input: dead ranks named, and LoRA/DeepSpeed arguments that cannot work refused.

Bad input, refused before the model is built with a message that says what to change:

* :func:`sat_patches.runtime.checks.check_lora_args` -- LoRA rank <= 0, ``layer_range`` outside the model's
  layers, ``--use_qlora`` without a working ``bitsandbytes``. Call it right after argument parsing (it reads ``num_layers``
  from the ``model_config.json`` of ``--from_pretrained`` when given a directory). The patch
  ``lora_args_check`` runs the same check in ``LoraMixin.__init__`` for scripts that do not call it
  (upstream's ``finetune_cogvlm_demo.py``): there it stops before any LoRA layer is allocated.
  Stock SAT takes ``r=0`` to a ``ZeroDivisionError`` (``lora_alpha / r``), a negative rank to a
  failed ``torch.empty``, and an out-of-range layer index silently adds no LoRA to it.
* ``deepspeed_config_json``: SAT's ``get_args`` ``json.load``s ``--deepspeed_config`` and a syntax
  error surfaces as a bare ``JSONDecodeError`` naming no file; now it names the file and line.

Dead ranks: a rank SIGKILLed (host OOM, as in THUDM/CogVLM#283 and THUDM/CogVLM#320) leaves the others waiting in a
collective for NCCL's/gloo's timeout (30 min by default), or failing with "Connection closed by peer"
that names nobody. The patch ``rank_heartbeat`` (on ``training_main``) runs a heartbeat thread per
rank: it bumps ``sat_patches/heartbeat/<rank>`` in the process group's store every
``timeout / 10`` s and watches every peer's counter. A peer silent for
``SAT_PATCHES_HEARTBEAT_TIMEOUT`` seconds (default 300) makes this rank print
"rank N stopped (no heartbeat for X s)", dump its stacks and exit with
:data:`sat_patches.diagnostics.watchdog.EXIT_CODE`
(through :func:`sat_patches.diagnostics.watchdog.fire`, which also tells the other ranks). A store that stops
answering for that long means its host (global rank 0) is gone. A rank finishing ``training_main``
marks itself done, so a normal end is not mistaken for a death. When a collective fails first
(gloo notices a closed socket), the failing rank names a peer silent for 3 beats (``timeout / 10``
each, at most 5 s) and exits; if none is silent it re-raises at once after that wait. Any other error
of the rank's own (not a lost connection) is raised at once, without that wait.
"""
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
