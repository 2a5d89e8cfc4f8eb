"""Predicted time of one training step, beside the memory estimate, so the plan can spend spare memory on speed.

    seconds = (useful FLOP + recomputed FLOP) / (EFFICIENCY * card's peak) + LAYER_PASS_SECONDS * layer passes

Useful FLOP: forward plus the input gradients of the parts gradients flow through; recomputed FLOP: the forward of
each fully checkpointed layer again (a selectively checkpointed one keeps its matrix products' outputs and recomputes
only its elementwise work: a layer pass, no FLOP counted). The two constants were fitted on an H200
(``tests/planning/test_plan_timing.py`` holds the table). Communication, offload and NF4 dequantisation are not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

from ..cogvlm.shapes import cross_tokens

# share of the card's peak that the step's useful and recomputed FLOP run at, and the host time per layer pass
EFFICIENCY = 0.57
LAYER_PASS_SECONDS = 1.7e-3


@dataclass(frozen=True)
class Card:
    name: str
    tflops: float           # peak dense bf16 tensor TFLOP/s
    memory_gb: float


# the levers the plan turns on by default on a kind of card: where the GPU kit's speed ladder
# (benchmarks/gpu/proof_ladder.py) measured them faster on it. Elsewhere they are asked for: `plan --selective`,
# SAT_PATCHES_CHECKPOINT_SELECTIVE, SAT_PATCHES_COMPILE_LAYERS=1
MEASURED_FASTER: Dict[str, FrozenSet[str]] = {"selective": frozenset(), "compiled": frozenset()}

# in the order a card is assumed from --gpu-mem (the first of those nearest in memory)
CARDS = {c.name: c for c in (
    Card("h100", 989, 80), Card("h200", 989, 141), Card("h100-pcie", 756, 80), Card("b200", 2250, 180),
    Card("a100", 312, 80), Card("a100-40gb", 312, 40), Card("l40s", 362, 48), Card("a6000", 155, 48),
    Card("rtx4090", 165, 24), Card("rtx3090", 71, 24), Card("a10", 125, 24), Card("l4", 121, 24),
)}


def card(name: Optional[str] = None, tflops: Optional[float] = None,
         memory_gb: Optional[float] = None) -> Tuple[Card, str]:
    """The card a plan is timed on and how it was chosen: ``tflops`` as given, else the named card, else the
    listed card nearest in memory to ``memory_gb``."""
    if tflops:
        return Card(name or f"{tflops:g} TFLOP/s", float(tflops), memory_gb or 0.0), "given"
    if name:
        key = name.lower().replace(" ", "").replace("_", "-")
        if key not in CARDS:
            raise ValueError(f"unknown GPU {name!r}: give one of {', '.join(CARDS)} or --tflops N")
        return CARDS[key], "given"
    if memory_gb is None:
        raise ValueError("a card needs a name, a throughput or a memory size")
    nearest = min(CARDS.values(), key=lambda c: abs(c.memory_gb - memory_gb))
    return nearest, f"assumed from {memory_gb:g} GB"


# rules the memory estimate reads too
def eva_skip_layers(skip: int, layers: int, eva_layers: int) -> int:
    """EVA layers left out of checkpointing when ``skip`` of the language model's ``layers`` are: the same
    share, rounded down, and at most all but one (SAT's bound on ``checkpoint_skip_layers``)."""
    return max(0, min(eva_layers - 1, skip * eva_layers // layers))


def checkpointed_layers(c: dict, s) -> Tuple[int, int]:
    """Checkpointed language and EVA layers: all but SAT's ``checkpoint_skip_layers`` last ones (EVA: the same
    share), none without ``s.checkpoint_activations``."""
    layers, eva_layers = c["num_layers"], (c.get("eva_args") or {}).get("num_layers", 0)
    if not s.checkpoint_activations:
        return 0, 0
    skip = min(s.checkpoint_skip_layers, layers)
    return layers - skip, eva_layers - (eva_skip_layers(skip, layers, eva_layers) if eva_layers else 0)


def selective_layers(checkpointed: int, share: float) -> int:
    """How many of a transformer's ``checkpointed`` layers checkpoint selectively at ``share`` (rounded half up):
    the runtime (``SAT_PATCHES_CHECKPOINT_SELECTIVE``) and the plan count them with this."""
    return min(checkpointed, int(share * checkpointed + 0.5))


def layer_states(layers: int, skip: int, share: float, checkpointing: bool = True) -> list:
    """Each layer's state, first to last: ``"full"``, ``"selective"`` or ``"none"`` (SAT's last ``skip``)."""
    if not checkpointing:
        return ["none"] * layers
    checkpointed = max(layers - skip, 0)
    selective = selective_layers(checkpointed, share)
    return ["full"] * (checkpointed - selective) + ["selective"] * selective + ["none"] * (layers - checkpointed)


def selective_counts(c: dict, s) -> Tuple[int, int]:
    """Selectively checkpointed language and EVA layers of setup ``s`` (its ``selective_share`` of each
    transformer's checkpointed layers)."""
    language, eva = checkpointed_layers(c, s)
    return selective_layers(language, s.selective_share), selective_layers(eva, s.selective_share)


def eva_trains(c: dict, s) -> bool:
    """Gradients flow through the EVA tower: LoRA on it (not under QLoRA), or upstream's demo set."""
    return bool(c.get("eva_args")) and (s.lora_eva and not s.qlora and s.lora_rank > 0 or s.train == "demo")


# FLOP and seconds
@dataclass(frozen=True)
class Passes:
    """Forward FLOP of one sample through each part, and the part's layer count."""
    language_layer: float
    language_layers: int
    head: float                 # the LM head: run once, never recomputed
    adapter: float = 0.0        # the GLU adapter over the image tokens: likewise
    eva_layer: float = 0.0
    eva_layers: int = 0
    encoder: float = 0.0        # CogAgent's EVA2-CLIP-L, whole
    encoder_layers: int = 0


def _linear(tokens: float, d_in: float, d_out: float) -> float:
    return 2.0 * tokens * d_in * d_out


def _attention(queries: float, keys: float, width: float, causal: bool = False) -> float:
    """Scores and the weighted sum; a causal mask halves the work the fused kernels do."""
    return 4.0 * queries * keys * width / (2 if causal else 1)


def forward_passes(c: dict, seq_len: int) -> Passes:
    """Forward FLOP per sample, from a ``model_config.json`` (every token passes one expert)."""
    h, f, t = c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"], seq_len
    layer = _linear(t, h, 3 * h) + _linear(t, h, h) + 3 * _linear(t, h, f) + _attention(t, t, h, causal=True)
    head = _linear(t, h, c["vocab_size"])
    e, out = c.get("eva_args"), {}
    if e:
        et, eh = e["max_sequence_length"], e["hidden_size"]
        out.update(eva_layer=_linear(et, eh, 4 * eh) + 2 * _linear(et, eh, e["inner_hidden_size"])
                   + _attention(et, et, eh), eva_layers=e["num_layers"])
        out.update(adapter=_linear(c.get("image_length", et), eh, h) + 3 * _linear(c.get("image_length", et), h, f))
    if c.get("cross_image_pix"):
        n, enc = cross_tokens(c), c["encoder_args"]
        inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
        layer += (_linear(t, h, inner) + _linear(n, c["cross_attn_hidden_size"], 2 * inner) + _linear(t, inner, h)
                  + _attention(t, n, inner))
        w, m = enc["width"], enc["width"] * enc["mlp_ratio"]
        block = _linear(n, w, 4 * w) + 3 * _linear(n, w, m) + _attention(n, n, w)
        out.update(encoder=enc["layers"] * block, encoder_layers=enc["layers"])
    return Passes(layer, c["num_layers"], head, **out)


@dataclass(frozen=True)
class StepTime:
    seconds: float
    tokens_per_s: float         # of the whole run: every data-parallel rank's samples
    useful_flop: float          # per rank and step
    recomputed_flop: float

    def as_dict(self) -> dict:
        return dict(step_seconds=self.seconds, tokens_per_s=self.tokens_per_s, useful_flop=self.useful_flop,
                    recomputed_flop=self.recomputed_flop)


def step_time(c: dict, s, tflops: float) -> StepTime:
    """Predicted step of setup ``s`` (:class:`sat_patches.planning.memory.Setup`) on a card of ``tflops``: its
    ``accumulation`` micro-batches, one after the other (the optimizer's own time is not modelled)."""
    p = forward_passes(c, s.seq_len)
    eva_back = eva_trains(c, s)
    encoder_back = s.train == "demo"
    forward = p.language_layers * p.language_layer + p.head + p.adapter + p.eva_layers * p.eva_layer + p.encoder
    backward = (p.language_layers * p.language_layer + p.head + p.adapter
                + (p.eva_layers * p.eva_layer if eva_back else 0) + (p.encoder if encoder_back else 0))
    lang_ckpt, eva_ckpt = checkpointed_layers(c, s)
    lang_selective, eva_selective = selective_counts(c, s)  # recompute the elementwise work only: a pass, no matmul
    recomputed = ((lang_ckpt - lang_selective) * p.language_layer
                  + ((eva_ckpt - eva_selective) * p.eva_layer if eva_back else 0))
    scale = s.micro_batch / s.mp
    useful, recomputed = scale * (forward + backward), scale * recomputed
    passes = (2 * p.language_layers + p.eva_layers * (2 if eva_back else 1)
              + p.encoder_layers * (2 if encoder_back else 1) + lang_ckpt + (eva_ckpt if eva_back else 0))
    seconds = s.accumulation * ((useful + recomputed) / (EFFICIENCY * tflops * 1e12) + LAYER_PASS_SECONDS * passes)
    return StepTime(seconds, s.global_batch * s.seq_len / seconds, s.accumulation * useful, s.accumulation * recomputed)
