"""Patches binding :mod:`sat_patches.lora` to SAT's ``lora2``: the layer, its injection, merge and QLoRA re-init.
Stock ``lora2`` copies every base layer to the CPU, never sums ``x @ A^T`` over row-parallel ranks, merges into a
plain ``nn.Linear(...).cuda()``, and fails with a ``NameError`` under ``qlora=True``. ``SAT_PATCHES_TRAINABLE=lora``:
only the LoRA adapters train, whatever the script leaves trainable (CogVLM's demos also train EVA layers, CogAgent's
the cross encoder and vision experts, which costs 24 GB cards their fit).
"""
from __future__ import annotations

from ..core.registry import Patch, delegate, expect_names, expect_params
from ..lora.layer import LoraLinear, merge_linear_lora, reinit_lora_mixin, replace_linear_with_lora
from ..runtime.trainable import setup_with_trainable_setting


def _expect_lora_linear(cls):
    return (expect_params("original_cls", "partition", "r", "original_obj")(cls.__init__)
            or expect_names("copy_to_model_parallel_region")(cls.forward))


def _replaced_by(ours):
    """A ``make`` that puts ``ours`` in the target's place (SAT's own is not called)."""
    return lambda original: ours


PATCHES = [
    Patch("lora_linear", "sat.model.finetune.lora2:LoraLinear", _replaced_by(LoraLinear),
          answers="LoRA by reference on the base weight's device/dtype; RowParallel LoRA all-reduces "
                  "x@A^T (stock SAT does not: model-parallel ranks disagree once B != 0); QLoRA NameError 'dtype' "
                  "(THUDM/CogVLM#438); CPU LoRA params under NCCL (THUDM/CogVLM#328); host-memory copies "
                  "(THUDM/CogVLM#283, #320)",
          expect=_expect_lora_linear),
    Patch("lora_replace", "sat.model.finetune.lora2:replace_linear_with_lora",
          _replaced_by(replace_linear_with_lora),
          answers="replace_linear_with_lora moves new LoRA params to the base's device (meta stays meta) "
                  "and sizes layers from in_size/out_size (THUDM/CogVLM#268)",
          expect=expect_params("lin", "partition", "r")),
    Patch("lora_merge", "sat.model.finetune.lora2:merge_linear_lora", _replaced_by(merge_linear_lora),
          answers="THUDM/CogVLM#117, #451: merge_linear_lora returns nn.Linear(...).cuda() (loses model "
                  "parallelism), assumes a bias for QLoRA (THUDM/CogVLM#257), dequantises NF4 with dequantize_fp4, "
                  "full-size temporaries",
          expect=expect_names("dequantize_fp4", "cuda")),
    Patch("lora_reinit", "sat.model.finetune.lora2:LoraMixin.reinit",
          delegate(reinit_lora_mixin, with_original=False),
          answers="LoraMixin(qlora=True).reinit leaves the transformer's linears float and unquantised, "
                  "cloning each (THUDM/CogVLM#438)",
          expect=expect_names("replace_linear_with_lora", "HackLinearNF4")),
    Patch("trainable_setting", "sat.training.deepspeed_training:setup_model_untrainable_params_and_optimizer",
          delegate(setup_with_trainable_setting),
          answers="CogVLM's finetune demos train far more than LoRA (EVA MLP layers 46-54; CogAgent's cross "
                          "encoder, vision experts, EVA); SAT_PATCHES_TRAINABLE=lora trains the adapters only",
          expect=expect_names("disable_untrainable_params")),
]
