"""The figures of the kit's peer part (``proof_peer.py``) that need no model: useful FLOPs from a CogVLM
configuration, tokens/s and utilisation of a measured step, and the table that sets the two stacks side by side.

Useful work is what any implementation of the step must compute: the forward, and the backward's gradients
with respect to the activations (the input-gradient backward; the frozen weights need no gradient, the LoRA
factors' are negligible). Each costs one multiply-add per weight per token that passes through it, plus
attention's two score products, so useful FLOPs = 2 x the forward's, and the forward's = 2 x its
multiply-adds. Counted for CogVLM from its ``model_config.json`` (SAT's names; the HF stack has the same
shapes) by the plan's time model: every token through one expert of each language layer (qkv, dense, gated MLP)
and the LM head, the image through every EVA2-CLIP layer (the patches and the class token), the GLU projector
over the patches, attention as the fused kernels run it (the language model causal: half the score matrix; EVA
bidirectional: all of it); the LoRA factors and EVA's patch embedding (1e-4 of the work) are left out. Full-size CogVLM at 1288 tokens:
2.90e13 FLOP forward, 5.79e13 useful per sample (micro-batch 8 in a 1.913 s step: 242 TFLOP/s useful).

Needs neither torch nor SAT (the plan's modules import neither).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from sat_patches.planning.shapes import plan_config
from sat_patches.planning.timing import forward_passes

PEER = "HF + PEFT"              # the released model's own HF code with PEFT's LoRA
OURS = "SAT + sat_patches"
TABLE_COLUMNS = ("stack", "setting", "step", "tokens/s", "peak", "useful TFLOP/s", "utilisation",
                 "sat_patches / HF")


def forward_macs(config: dict, tokens: int) -> Dict[str, float]:
    """Multiply-adds of one sample's forward through CogVLM ``config`` at ``tokens`` tokens, by part: the count of
    the plan's time model (:func:`sat_patches.planning.timing.forward_passes`, attention inside its layers), so the
    kit's utilisation and the plan's predictions share one definition of the work."""
    p = forward_passes(plan_config(config), tokens)
    flops = {"language layers": p.language_layers * p.language_layer, "LM head": p.head, "GLU projector": p.adapter,
             "EVA layers": p.eva_layers * p.eva_layer}
    return {part: value / 2 for part, value in flops.items()}


def forward_flops(config: dict, tokens: int) -> float:
    """FLOPs of one sample's forward (two per multiply-add)."""
    return 2.0 * sum(forward_macs(config, tokens).values())


def useful_flops(config: dict, tokens: int) -> float:
    """FLOPs of one sample's useful work: the forward and the input-gradient backward (the same again)."""
    return 2.0 * forward_flops(config, tokens)


@dataclass
class StepFigures:
    """One stack's step at one setting, as measured, with what follows from it."""
    stack: str
    setting: str
    micro_batch: int
    tokens: int                  # per sample
    seconds: float               # one step (forward, loss, backward, AdamW)
    peak: Optional[float]        # bytes (max_memory_allocated); None off CUDA
    useful_per_sample: float     # FLOPs, :func:`useful_flops`
    matmul_peak: float           # FLOP/s a large matrix product reaches on the same device and dtype
    lora_modules: int = 0
    trainable: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.micro_batch * self.tokens / self.seconds

    @property
    def useful_flops_per_s(self) -> float:
        return self.micro_batch * self.useful_per_sample / self.seconds

    @property
    def utilisation(self) -> float:
        """Useful FLOP/s as a share of what the device's matrix products reach."""
        return self.useful_flops_per_s / self.matmul_peak

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "useful_flops_per_s": self.useful_flops_per_s,
                "utilisation": self.utilisation}


def ratios(rows: Sequence[StepFigures]) -> Dict[str, float]:
    """sat_patches' tokens/s over HF's, per setting both stacks measured."""
    by = {(r.stack, r.setting): r for r in rows}
    return {setting: by[OURS, setting].tokens_per_s / by[PEER, setting].tokens_per_s
            for stack, setting in by if stack == OURS and (PEER, setting) in by}


def table(rows: Sequence[StepFigures]) -> str:
    """The side-by-side table (Markdown): one line per stack and setting, the ratio on sat_patches' line."""
    ratio = ratios(rows)
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"]
    for r in rows:
        cells = (r.stack, r.setting, f"{r.seconds:.3f} s", f"{r.tokens_per_s:,.0f}",
                 "-" if r.peak is None else f"{r.peak / 1e9:.2f} GB", f"{r.useful_flops_per_s / 1e12:.3g}",
                 f"{r.utilisation:.0%}", f"{ratio[r.setting]:.2f}x" if r.stack == OURS and r.setting in ratio else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def setting_name(micro_batch: int, checkpointed: bool) -> str:
    return f"micro-batch {micro_batch}, " + ("every layer checkpointed" if checkpointed else "no checkpointing")


def as_dicts(rows: Sequence[StepFigures]) -> List[dict]:
    return [r.as_dict() for r in rows]
