"""A SAT LoRA run's adapters as a PEFT adapter for the exported model (``sat-patches export peft ADAPTER OUT``).

SAT's ``partition`` (A_i, B_i) pairs of rank r on a fused layer become one LoRA of rank ``partition * r`` on HF's
fused ``language_expert_query_key_value``: A the A_i stacked, B block-diagonal, ``lora_alpha * partition``
(``alpha_pattern``) beside that rank (``rank_pattern``), so the update to every weight is SAT's exactly.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from ..checkpoints import writer
from . import names, stream
from .source import ExportError, Lora, SatCheckpoint


def fused(lora: Lora):
    """``(A, B)`` of one LoRA of rank ``len(A_i) * r`` equal to SAT's stacked pairs: A stacked, B block-diagonal."""
    a = torch.cat(lora.A, dim=0)
    b = torch.zeros(sum(x.shape[0] for x in lora.B), a.shape[0], dtype=lora.B[0].dtype)
    row = 0
    for i, part in enumerate(lora.B):
        b[row:row + part.shape[0], i * lora.rank:(i + 1) * lora.rank] = part
        row += part.shape[0]
    return a, b


def export_peft(checkpoint: str, out: str, iteration: Optional[int] = None, lora_alpha: float = 1.0,
                overwrite: bool = False, base_model: Optional[str] = None) -> dict:
    """Write the PEFT adapter of the LoRA in ``checkpoint`` (an adapter-only save, or a whole save with
    unmerged LoRA) at ``out``."""
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out} exists; choose a new output folder or pass --overwrite")
    src = SatCheckpoint(checkpoint, iteration, lora_alpha)
    if not src.loras:
        raise ExportError(f"{checkpoint} holds no LoRA matrices (matrix_A/matrix_B): nothing to export as a "
                          f"PEFT adapter (a merged model goes out whole: export hf)")
    tensors: Dict[str, torch.Tensor] = {}
    targets, ranks, alphas = [], {}, {}
    r = None
    for path in sorted(src.loras):
        lora = src.lora(path)
        module = names.hf_name(path + ".weight")[: -len(".weight")]
        a, b = fused(lora)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        targets.append(module)
        r = lora.rank if r is None else r
        if lora.rank != r:
            raise ExportError(f"{checkpoint}: LoRA ranks differ ({r} and {lora.rank} on '{path}'); one rank per run")
        if len(lora.A) > 1:
            ranks[module] = a.shape[0]
            alphas[module] = lora_alpha * len(lora.A)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r, "lora_alpha": lora_alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": targets, "rank_pattern": ranks, "alpha_pattern": alphas, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
    }
    plan = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    with writer.new_dir(out) as tmp:
        stream.write_safetensors(os.path.join(tmp, "adapter_model.safetensors"), plan, tensors.__getitem__)
        stream.write_json(os.path.join(tmp, "adapter_config.json"), config)
    return {"layers": len(targets), "rank": r, "fused": len(ranks)}
