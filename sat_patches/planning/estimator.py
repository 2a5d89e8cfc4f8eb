"""``sat-patches plan``: memory per GPU and per host of a CogVLM/CogAgent fine-tuning run, for every
model-parallel size / ZeRO stage / optimizer offload / micro-batch, before any GPU hour is spent.

Counted from the models' real component sizes (upstream ``model_config.json`` fields and model code,
THUDM/CogVLM ``utils/models``): the LLaMA-7B language model, the vision-expert copies of its
attention and MLP, the EVA2-CLIP-E vision tower and the GLU adapter; CogAgent adds cross attention in
every layer and the 1120-px EVA2-CLIP-L encoder. ``cogvlm-base-224`` with upstream's LoRA (rank 10 on
the language model and EVA) counts 17,657,466,368 parameters, the number SAT prints in CogVLM issue
117. The same counting applies to any ``model_config.json`` (LLaMA-shaped, with or without the
vision parts), which is how the estimate is checked against the memory ledger on CPU ranks.

What one rank holds (bytes; P parameters of the rank's share, T trainable of them, dp data-parallel
ranks; bf16/fp16 unless fp32):

* weights 2P; trainable gradients 2T (ZeRO-2: 2T/dp); fp32 master copy, fp32 gradients and Adam's
  two moments 16T/dp for ZeRO-1/2 (18T without ZeRO) -- on the host instead with optimizer offload;
  fp32 training keeps gradients and Adam moments (12T, ZeRO: /dp).
* activations: with ``--checkpoint-activations`` each layer's input plus one layer's working set, except
  SAT's ``checkpoint_skip_layers`` last layers (and the same share of EVA's), which keep their whole working set;
  else every layer's working set, per kind of layer (the vision-expert LLaMA layer, with CogAgent's cross
  attention; the EVA2-CLIP-E layer) as measured on the real model at full size
  (``benchmarks/calibration/layer_bytes.py``, ``benchmarks/plan_calibration.py``); the logits of the full
  vocabulary on every rank (the LM head gathers them) as the loss's four fp32 tensors; the EVA tower's
  activations when any of its weights train (LoRA on EVA does).
* a fixed runtime share: CUDA context, NCCL and allocator slack on a GPU; the Python/torch/SAT/
  DeepSpeed process on the host.

The host estimate assumes sat_patches: models are built on the GPU in the run's dtype and checkpoints
are read through mmap in chunks. Stock SwissArmyTransformer 0.4.12 is shown beside it: every rank builds its share in
fp32 on the CPU and ``torch.load``s the whole checkpoint, and with MP>1 node rank 0 also builds the
whole model (CogVLM issues 283 and 320, "kill -9").
"""
from __future__ import annotations

import copy
import itertools
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

from ..cogvlm.shapes import EVA_CLIP_L_DEFAULTS, RELEASED, cross_tokens, upstream_config
from ..core import settings
from ..core.kinds import KINDS
from .timing import Card, StepTime, card, checkpointed_layers, eva_skip_layers, eva_trains, step_time

GB = 1e9
GiB = 2 ** 30

# --------------------------------------------------------------------------------------
# Model shapes: the released model_config.json fields (sat_patches.cogvlm.shapes, the models' own table)
# --------------------------------------------------------------------------------------
def plan_config(config: dict) -> dict:
    """A CogVLM/CogAgent ``model_config.json`` as the plan reads it: every language layer has vision experts
    (upstream's models add them to all of them), CogAgent's encoder with the code's defaults."""
    config = copy.deepcopy(config)
    if config.get("model_class", "").startswith(("CogVLM", "CogAgent", "FineTuneTrainCog")):
        config.setdefault("num_vision_layers", config["num_layers"])
    if config.get("cross_image_pix"):
        config["encoder_args"] = {**EVA_CLIP_L_DEFAULTS, **(config.get("encoder_args") or {})}
    return config


def _released() -> Dict[str, dict]:
    return {name: plan_config(upstream_config(name)) for name in RELEASED}


MODELS = _released()
# upstream finetune_demo --max_length (it includes the image tokens)
DEMO_MAX_LENGTH = {490: 1288, 224: 400}

# runtime shares (measured on this project's CPU ranks; usual sizes on CUDA)
HOST_BASE_CPU = 0.40 * GiB     # python + torch + SAT + DeepSpeed + gloo, one CPU rank by its first step (ledger, 2 ranks)
HOST_BASE_CUDA = 3.0 * GiB     # the same process with CUDA libraries loaded
GPU_RUNTIME = 1.0 * GiB        # CUDA context, NCCL buffers, allocator slack
# the mapped checkpoint is copied in pieces of this size (checkpoints.sharding.CHUNK_BYTES: the setting's default)
LOAD_CHUNK = settings.SETTINGS["SAT_PATCHES_LOAD_CHUNK_MB"].default * 2 ** 20
GPU_MARGIN = 0.05              # keep this fraction of the card free
HOST_MARGIN = 0.10


@dataclass
class Part:
    """Parameters of one model component: ``split`` ones are divided over model-parallel ranks."""
    name: str
    split: int = 0
    replicated: int = 0
    buffer: bool = False            # persistent buffers: memory, not parameters

    def per_rank(self, mp: int) -> float:
        return self.split / mp + self.replicated

    @property
    def total(self) -> int:
        return self.split + self.replicated


def _linear(d_in, d_out, bias, kind="column") -> Part:
    """A SAT parallel linear: column-parallel splits weight and bias; row-parallel splits the weight."""
    split = d_in * d_out + (d_out if bias and kind == "column" else 0)
    return Part("", split, d_out if bias and kind == "row" else 0)


def _sum(name, parts, times=1) -> Part:
    return Part(name, times * sum(p.split for p in parts), times * sum(p.replicated for p in parts))


def language_parts(c: dict) -> List[Part]:
    h, f, L, V = c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"], c["num_layers"], c["vocab_size"]
    bias = c.get("use_bias", True)
    layer = [_linear(h, 3 * h, bias), _linear(h, h, bias, "row"), _linear(h, f, bias), _linear(f, h, bias, "row"),
             _linear(h, f, False), Part("", 0, 2 * h)]          # qkv, dense, h->4h, 4h->h, LLaMA gate, 2 RMSNorms
    vocab = Part("", V * h) if V >= 1000 else Part("", 0, V * h)   # SAT: VocabParallelEmbedding from 1000 up
    return [Part("embedding + LM head", vocab.split + V * h, vocab.replicated + h),
            _sum("language layers", layer, L)]


def vision_expert_parts(c: dict) -> List[Part]:
    n = c.get("num_vision_layers", 0)
    if not n:
        return []
    h, f = c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"]
    n = min(n, c["num_layers"])
    attn = [_linear(h, 3 * h, c.get("vision_qkv_bias", False)), _linear(h, h, False, "row")]
    mlp = [_linear(h, f, False), _linear(h, f, False), _linear(f, h, False, "row")]
    return [_sum("vision-expert attention", attn, n), _sum("vision-expert MLP", mlp, n)]


def _eva_layer(e: dict) -> List[Part]:
    h, f = e["hidden_size"], e["inner_hidden_size"]
    return [Part("", 0, 4 * h), _linear(h, 3 * h, True), _linear(h, h, True, "row"),
            _linear(h, f, True), _linear(f, h, True, "row")]


def eva_parts(c: dict) -> List[Part]:
    e = c.get("eva_args")
    if not e:
        return []
    h, h_lm, f_lm = e["hidden_size"], c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"]
    patch_embedding = h * e.get("in_channels", 3) * e["patch_size"] ** 2 + h
    embed = e.get("vocab_size", 1) * h + e["max_sequence_length"] * h + patch_embedding
    tower = _sum("EVA2-CLIP vision tower", _eva_layer(e), e["num_layers"])
    tower.replicated += embed
    glu = h * h_lm + 2 * h_lm + 3 * h_lm * f_lm + 2 * h_lm       # linear_proj, norm1, 3 MLP matrices, boi/eoi
    if c.get("cross_image_pix"):
        glu += c["image_length"] * h                              # CogAgent's ImageMixin.pos_embed
    return [tower, Part("GLU adapter", 0, glu)]


def cross_parts(c: dict) -> List[Part]:
    """CogAgent: cross attention in every language layer and the high-resolution EVA2-CLIP-L encoder."""
    if not c.get("cross_image_pix"):
        return []
    h, L = c["hidden_size"], c["num_layers"]
    inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
    layer = [_linear(h, inner, False), _linear(c["cross_attn_hidden_size"], 2 * inner, False),
             _linear(inner, h, False, "row"), Part("", 0, h)]
    enc = c["encoder_args"]
    w, m, p = enc["width"], int(enc["width"] * enc["mlp_ratio"]), enc["patch_size"]
    n = cross_tokens(c)
    block = 2 * w + 2 * w + 3 * w * w + 2 * w + w * w + w + 2 * w + 2 * (m * w + m) + 2 * m + w * m + w
    encoder = (n * w + w + (n + 1) * w + 3 * w * p * p + w + enc["layers"] * block + 2 * w
               + enc["embed_dim"] * w + enc["embed_dim"])
    rope_buffers = 2 * n * enc["head_width"] * (enc["layers"] + 1)
    return [_sum("cross attention", layer, L), Part("EVA2-CLIP-L encoder", 0, encoder),
            Part("encoder rotary tables", 0, rope_buffers, buffer=True)]


def model_parts(c: dict) -> List[Part]:
    return language_parts(c) + vision_expert_parts(c) + eva_parts(c) + cross_parts(c)


def lora_parts(c: dict, rank: int, eva: bool = True) -> List[Part]:
    """SAT ``LoraMixin`` on every layer's attention (qkv with 3 partitions, dense), on EVA's layers as
    upstream's demo adds, and on CogAgent's cross attention. Column-parallel: B split; row: A split."""
    if not rank:
        return []
    r = rank

    def attention(h):  # qkv: A 3 x (r, h) full, B 3 x (h, r) split; dense (row): A (r, h) split, B (h, r) full
        return Part("", 3 * h * r + r * h, 3 * r * h + h * r)
    parts = [_sum("LoRA (language)", [attention(c["hidden_size"])], c["num_layers"])]
    if eva and c.get("eva_args"):
        e = c["eva_args"]
        parts.append(_sum("LoRA (EVA)", [attention(e["hidden_size"])], e["num_layers"]))
    if c.get("cross_image_pix"):
        h, ch = c["hidden_size"], c["cross_attn_hidden_size"]
        inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
        cross = Part("", inner * r + r * inner + 2 * inner * r, h * r + r * h + 2 * r * ch)
        parts.append(_sum("LoRA (cross attention)", [cross], c["num_layers"]))
    return parts


def demo_trainable_parts(c: dict) -> List[Part]:
    """Beyond LoRA, what upstream's finetune_demo ``disable_untrainable_params`` leaves trainable:
    CogVLM the MLP of EVA layers 46-54; CogAgent the encoder, cross attention, GLU adapter, both
    vision experts, boi/eoi and the whole EVA tower (names matched as upstream does)."""
    e = c.get("eva_args")
    if not e:
        return []
    if not c.get("cross_image_pix"):
        layers = KINDS["cogvlm"].demo_eva_mlp_layers(e["num_layers"])
        h, f = e["hidden_size"], e["inner_hidden_size"]
        return [_sum("EVA MLP, layers 46-54", [_linear(h, f, True), _linear(f, h, True, "row")], layers)]
    named = {p.name: p for p in model_parts(c)}
    return [named[n] for n in ("EVA2-CLIP-L encoder", "cross attention", "GLU adapter", "vision-expert attention",
                               "vision-expert MLP", "EVA2-CLIP vision tower")]


def parameter_count(c: dict, lora_rank: int = 0, lora_eva: bool = True) -> int:
    return int(sum(p.total for p in model_parts(c) + lora_parts(c, lora_rank, lora_eva) if not p.buffer))


def heads(c: dict) -> List[int]:
    """Head counts a model-parallel size must divide."""
    out = [c["num_attention_heads"]]
    if c.get("eva_args"):
        out.append(c["eva_args"]["num_attention_heads"])
    return out


# --------------------------------------------------------------------------------------
# Memory of one setup
# --------------------------------------------------------------------------------------
@dataclass
class Setup:
    gpus: int = 1                   # GPUs (ranks) per node
    nodes: int = 1
    mp: int = 1
    zero: int = 2
    offload: bool = False
    micro_batch: int = 1
    dtype: str = "bf16"             # bf16 | fp16 | fp32
    seq_len: int = 1288
    lora_rank: int = 10
    lora_eva: bool = True
    train: str = "lora"             # lora | demo (upstream finetune_demo's trainable set)
    checkpoint_activations: bool = True
    checkpoint_skip_layers: int = 0  # the last N language layers not checkpointed (SAT's), the same share of EVA's
    qlora: bool = False             # NF4 base (upstream's --use_qlora): MP=1, LoRA on the language model only
    device: str = "cuda"            # cuda | cpu (CPU ranks: everything is host memory)
    reduce_bucket: float = 4e7      # zero_optimization.reduce_bucket_size (upstream's configs)
    allgather_bucket: float = 1e8

    @property
    def dp(self) -> int:
        return max(1, self.gpus * self.nodes // self.mp)

    @property
    def weight_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2


@dataclass
class Estimate:
    setup: Setup
    params: int
    trainable: int
    device: Dict[str, float] = field(default_factory=dict)      # per GPU (or per CPU rank), bytes
    host: Dict[str, float] = field(default_factory=dict)        # per rank on the host, bytes
    host_stock_node: float = 0.0                                # per node, stock SwissArmyTransformer 0.4.12

    @property
    def per_gpu(self) -> float:
        return sum(self.device.values())

    @property
    def host_rank(self) -> float:
        return sum(self.host.values())

    @property
    def host_node(self) -> float:
        return self.host_rank * self.setup.gpus

    @property
    def cpu_rank(self) -> float:
        """CPU ranks: everything a rank holds, in host memory."""
        return self.per_gpu + self.host_rank

    def as_dict(self) -> dict:
        return dict(setup=asdict(self.setup), params=self.params, trainable=self.trainable,
                    device=self.device, host=self.host, per_gpu=self.per_gpu, host_per_rank=self.host_rank,
                    host_per_node=self.host_node, host_stock_per_node=self.host_stock_node)


@dataclass(frozen=True)
class LayerKeeps:
    """Values one layer keeps for backward, per token: of the hidden size whole on every model-parallel rank
    (input, norms, residual, routing copies), of the hidden size split over the ranks (qkv, rotary, context,
    expert outputs), of its MLP width (split); plus one fp32 log-sum-exp per local head: SAT runs CogVLM's
    causal and EVA's full attention through ``scaled_dot_product_attention``, whose fused kernels keep no
    score matrix. Measured on the real model at full size (``benchmarks/calibration/layer_bytes.py``)."""
    whole: float
    split: float
    ffn: float

    def bytes(self, tokens, hidden, ffn, heads, mp, wb) -> float:
        values = self.whole * hidden + (self.split * hidden + self.ffn * ffn) / mp
        return tokens * wb * values + tokens * heads / mp * 4


# With the base frozen and LoRA on the attention: the vision-expert LLaMA layer keeps three MLP-wide values (the
# gate, its SiLU, the up projection; the frozen down projection keeps nothing), the EVA2-CLIP-E layer one (the
# GELU's input). A trained EVA MLP (upstream's demo) also keeps the inputs of its two linears.
LANGUAGE_LAYER = LayerKeeps(whole=6, split=6, ffn=3)
EVA_LAYER = LayerKeeps(whole=3, split=6, ffn=1)
EVA_LAYER_MLP_TRAINED = LayerKeeps(whole=4, split=6, ffn=2)
# upstream's CogAgent demo trains the vision experts and the cross attention: more per vision token (boi + image)
EXPERTS_TRAINED = LayerKeeps(whole=5, split=1, ffn=1)
# a layer of CogAgent's EVA2-CLIP-L encoder when it trains (upstream's demo); plain torch: never split
ENCODER_LAYER = LayerKeeps(whole=10, split=0, ffn=5)


def cross_layer_bytes(c: dict, tokens: int, mp: int, wb: int) -> float:
    """CogAgent's cross attention in one language layer: the encoder's output as LoRA's input to the keys and
    values (whole), the keys and values (split), the query side at the text length; the mask is full, so
    the fused attention keeps no score matrix."""
    n = cross_tokens(c)
    inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
    return wb * (n * (c["cross_attn_hidden_size"] + 2 * inner / mp) + tokens * (c["hidden_size"] + 2 * inner / mp))


def _stack(per_layer: List[float], layer_input: float, checkpointed: int) -> float:
    """Activations of a stack of layers that keep ``per_layer`` each when ``checkpointed`` of them (the first
    ones) are: a checkpointed layer keeps its input; the others (SAT's ``checkpoint_skip_layers``, the last)
    keep their whole working set until backward, which goes through them first and frees it before the first
    checkpointed layer is recomputed, one at a time."""
    kept, recomputed = per_layer[checkpointed:], per_layer[:checkpointed]
    return checkpointed * layer_input + max(sum(kept), max(recomputed, default=0))


def _eva_mlp_trained_layers(c: dict, s: Setup) -> int:
    """EVA layers whose MLP trains: upstream's demo trains CogVLM's layers 46-54 and CogAgent's whole tower."""
    layers = c["eva_args"]["num_layers"]
    if s.train != "demo":
        return 0
    return KINDS["cogagent" if c.get("cross_image_pix") else "cogvlm"].demo_eva_mlp_layers(layers)


def _activations(c: dict, s: Setup, eva_trains: bool) -> Dict[str, float]:
    wb, b, mp, t = s.weight_bytes, s.micro_batch, s.mp, s.seq_len
    language_checkpointed, eva_checkpointed = checkpointed_layers(c, s)
    h, f, L = c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"], c["num_layers"]
    one = b * LANGUAGE_LAYER.bytes(t, h, f, c["num_attention_heads"], mp, wb)
    if c.get("cross_image_pix"):
        one += b * cross_layer_bytes(c, t, mp, wb)
        if s.train == "demo":
            one += b * EXPERTS_TRAINED.bytes(c["image_length"] + 1, h, f, 0, mp, wb)
    out = {"activations (language)": _stack([one] * L, b * t * h * wb, language_checkpointed)}
    # the LM head gathers its output (ColumnParallelLinear, gather_output=True): every rank holds the full vocabulary;
    # at the loss's peak four fp32 (b, t, vocab) tensors are alive: the logits, their shifted copy, the log-softmax
    # and its gradient (benchmarks/calibration/live_bytes.py on the head and loss, at MP 1 and 2)
    out["logits and loss"] = b * t * c["vocab_size"] * 4 * 4
    e = c.get("eva_args")
    if e:
        et = e["max_sequence_length"]

        def eva_layer(keeps: LayerKeeps) -> float:
            return b * keeps.bytes(et, e["hidden_size"], e["inner_hidden_size"], e["num_attention_heads"], mp, wb)
        trained_mlp = _eva_mlp_trained_layers(c, s)
        layers = ([eva_layer(EVA_LAYER_MLP_TRAINED)] * trained_mlp
                  + [eva_layer(EVA_LAYER)] * (e["num_layers"] - trained_mlp))
        out["activations (EVA)"] = (_stack(layers, b * et * e["hidden_size"] * wb, eva_checkpointed)
                                    if eva_trains else eva_layer(EVA_LAYER))
    if c.get("cross_image_pix"):
        enc, n = c["encoder_args"], cross_tokens(c)
        # the encoder's output, which every layer's cross attention reads; frozen (TRAINABLE=lora), the encoder
        # keeps nothing else for backward; trained (demo), every layer's values (upstream does not checkpoint it)
        out["activations (cross branch)"] = b * n * enc["width"] * wb
        if s.train == "demo":
            width = enc["width"]
            layer = ENCODER_LAYER.bytes(n, width, width * enc["mlp_ratio"], width // enc["head_width"], 1, wb)
            out["activations (cross branch)"] += b * enc["layers"] * layer
    return out


# QLoRA: what ``LoraMixin(qlora=True)`` makes NF4 (the language model's linears and its vision experts;
# not EVA, the embeddings or the LM head). NF4 holds 4 bits per weight plus, per block of 64, an 8-bit
# absmax (double quantisation), and per 256 blocks an fp32 scale: 0.5 + 1/64 + 4/16384 bytes.
QLORA_PARTS = ("language layers", "vision-expert attention", "vision-expert MLP", "cross attention")
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def estimate(config: dict, setup: Setup) -> Estimate:
    s, c = setup, config
    parts = model_parts(c)
    lora = lora_parts(c, s.lora_rank, s.lora_eva and not s.qlora)
    extra = demo_trainable_parts(c) if s.train == "demo" else []
    per_rank = lambda ps: sum(p.per_rank(s.mp) for p in ps)  # noqa: E731
    P, T = per_rank(parts + lora), per_rank(lora + extra)
    wb, dp = s.weight_bytes, s.dp
    if s.qlora:
        nf4 = per_rank([p for p in parts if p.name in QLORA_PARTS])
        device: Dict[str, float] = {"weights (NF4)": nf4 * NF4_BYTES, "weights": (P - nf4) * wb}
    else:
        device = {"weights": P * wb}
    host: Dict[str, float] = {}
    mixed = s.dtype != "fp32"
    optimizer = (16 if mixed else 12) * T            # fp32 master + fp32 grads + Adam (mixed); grads + Adam (fp32)
    grads = 2 * T if mixed else 0                    # the low-precision .grad of every trainable weight
    if s.zero == 0:
        device["gradients"] = grads
        device["optimizer states"] = optimizer + (2 * T if mixed else 0)
    else:
        device["gradients"] = grads / dp if s.zero >= 2 else grads
        states = optimizer / dp
        (host if s.offload else device)["optimizer states" + (" (offloaded)" if s.offload else "")] = states
        device["ZeRO buckets"] = min(T, s.reduce_bucket) * wb * 2 + min(P, s.allgather_bucket) * wb * (s.zero >= 1)
    device.update(_activations(c, s, eva_trains(c, s)))
    if s.device == "cuda":
        device["CUDA context, NCCL, allocator"] = GPU_RUNTIME
        host["process (torch, CUDA, SAT, DeepSpeed)"] = HOST_BASE_CUDA
        host["checkpoint chunk (mmap)"] = LOAD_CHUNK
    else:
        host["process (torch, SAT, DeepSpeed)"] = HOST_BASE_CPU
    total_params = sum(p.total for p in parts + lora if not p.buffer)
    est = Estimate(s, int(total_params), int(sum(p.total for p in lora + extra)), device, host)
    est.host_stock_node = stock_host_per_node(total_params, s)
    return est


def stock_host_per_node(params: float, s: Setup) -> float:
    """Stock SwissArmyTransformer 0.4.12: each rank builds its share in fp32 on the CPU (``get_model``) and, from an
    MP=1 checkpoint at MP=1, ``torch.load``s the whole file; at MP>1 node rank 0 also builds the whole
    model in fp32 and loads the whole checkpoint to send partitions."""
    base = HOST_BASE_CUDA if s.device == "cuda" else HOST_BASE_CPU
    checkpoint = 2 * params
    if s.mp == 1:
        return s.gpus * (base + max(4 * params, checkpoint))
    return s.gpus * (base + 4 * params / s.mp) + max(4 * params, 2 * params + checkpoint)


# --------------------------------------------------------------------------------------
# Choosing
# --------------------------------------------------------------------------------------
@dataclass
class Option:
    estimate: Estimate
    fits_gpu: bool
    fits_host: bool
    reason: str = ""
    time: Optional[StepTime] = None     # predicted on the card the options were made for

    @property
    def viable(self) -> bool:
        return self.fits_gpu and self.fits_host


def model_parallel_sizes(config: dict, world: int) -> List[int]:
    return [m for m in range(1, world + 1) if world % m == 0 and all(n % m == 0 for n in heads(config))]


def _checkpointing(config: dict, setup: Setup, fits) -> List[Setup]:
    """The checkpointing settings worth timing for ``setup``: every layer checkpointed (the least memory), the
    most layers left out of it that still ``fits`` (SAT's ``checkpoint_skip_layers``: the fastest with
    checkpointing; memory grows with it, so a bisection finds it) and none checkpointed."""
    def skipping(k: int) -> Setup:
        return replace(setup, checkpoint_activations=True, checkpoint_skip_layers=k)
    low, high = 0, config["num_layers"] - 1          # SAT keeps at least one layer checkpointed
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(skipping(middle)) else (low, middle - 1)
    return [skipping(k) for k in sorted({0, low})] + [replace(setup, checkpoint_activations=False)]


def options(config: dict, gpus: int, gpu_mem_gb: float, host_mem_gb: Optional[float] = None, nodes: int = 1,
            zero: Optional[int] = None, offload: Optional[bool] = None, micro_batch: Optional[int] = None,
            gpu: Optional[Card] = None, checkpoint_skip_layers: Optional[int] = None,
            **setup_fields) -> List[Option]:
    """Every (MP, ZeRO, offload, micro-batch, checkpointing) combination, each with its estimate, verdict and
    predicted step on ``gpu`` (default: the card :func:`sat_patches.planning.timing.card` assumes from
    ``gpu_mem_gb``). Checkpointing: all layers, the most left out that fit, none (:func:`_checkpointing`);
    only ``checkpoint_skip_layers`` when given; none with ``checkpoint_activations=False``."""
    gpu = gpu or card(memory_gb=gpu_mem_gb)[0]
    mps = model_parallel_sizes(config, gpus * nodes)
    zeros = [zero] if zero is not None else [0, 1, 2]
    offloads = [offload] if offload is not None else [False, True]
    batches = [micro_batch] if micro_batch else [1, 2, 4, 8]
    qloras = [setup_fields.pop("qlora")] if "qlora" in setup_fields else [False, True]
    if setup_fields.get("train", "lora") != "lora":
        qloras = [q for q in qloras if not q]  # QLoRA trains the adapters only
    out = []
    for mp, z, off, mb, q in itertools.product(mps, zeros, offloads, batches, qloras):
        if off and z == 0:
            continue  # DeepSpeed offloads the optimizer only under ZeRO
        if q and mp > 1:
            continue  # an NF4 base has no model-parallel forward
        base = Setup(gpus=gpus, nodes=nodes, mp=mp, zero=z, offload=off, micro_batch=mb, qlora=q, **setup_fields)
        if not base.checkpoint_activations:
            setups = [base]
        elif checkpoint_skip_layers is not None:
            setups = [replace(base, checkpoint_skip_layers=checkpoint_skip_layers)]
        else:
            setups = _checkpointing(config, base, lambda s: estimate(config, s).per_gpu <= gpu_mem_gb * GB * (1 - GPU_MARGIN))
        for setup in setups:
            est = estimate(config, setup)
            fits_gpu = est.per_gpu <= gpu_mem_gb * GB * (1 - GPU_MARGIN)
            fits_host = host_mem_gb is None or est.host_node <= host_mem_gb * GB * (1 - HOST_MARGIN)
            reason = "" if fits_gpu else f"needs {est.per_gpu / GB:.1f} GB per GPU"
            if not fits_host:
                reason = (reason + "; " if reason else "") + f"needs {est.host_node / GB:.0f} GB host memory"
            out.append(Option(est, fits_gpu, fits_host, reason, step_time(config, setup, gpu.tflops)))
    return out


def _preference(o: Option):
    s = o.estimate.setup
    return (s.qlora, s.mp, s.offload, -o.time.tokens_per_s, {2: 0, 1: 1, 0: 2}.get(s.zero, 3))


def recommend(opts: List[Option]) -> Optional[Option]:
    """The viable option without QLoRA if there is one (a bf16 base), with the smallest MP (most data
    parallelism), then no offload, then the most tokens per second predicted (micro-batch and checkpointing:
    spare memory spent on speed), then ZeRO-2 (upstream's stage)."""
    viable = [o for o in opts if o.viable]
    return min(viable, key=_preference) if viable else None


def deepspeed_config(s: Setup) -> dict:
    """A DeepSpeed config realising ``s`` in upstream's style (finetune_demo/test_config_bf16.json),
    with ``offload_optimizer`` inside ``zero_optimization`` where DeepSpeed reads it."""
    config = {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.1}
    if s.zero:
        zero = {"stage": s.zero, "contiguous_gradients": False, "overlap_comm": True, "reduce_scatter": True,
                "reduce_bucket_size": s.reduce_bucket, "allgather_bucket_size": s.allgather_bucket,
                "load_from_fp32_weights": False}
        if s.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_optimization"] = zero
        config["zero_allow_untested_optimizer"] = True
    config["bf16"] = {"enabled": s.dtype == "bf16"}
    if s.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "min_loss_scale": 1}
    config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 5e-2}}
    return config


def checkpoint_options(s: Setup) -> List[str]:
    """The trainer options realising ``s``'s checkpointing: SAT's ``--checkpoint-activations`` and
    ``--checkpoint-skip-layers`` for the language model, upstream's ``--vit_checkpoint_activations`` for EVA
    (the standalone trainer leaves the same share of EVA's layers out)."""
    if not s.checkpoint_activations:
        return []
    skip = ["--checkpoint-skip-layers", str(s.checkpoint_skip_layers)] if s.checkpoint_skip_layers else []
    return ["--checkpoint-activations", "--vit_checkpoint_activations", *skip]


def script_settings(s: Setup) -> Dict[str, str]:
    """Environment of upstream's finetune_*_lora.sh that realises ``s``."""
    settings = {"NUM_GPUS_PER_WORKER": str(s.gpus), "MP_SIZE": str(s.mp), "LOCAL_WORLD_SIZE": str(s.gpus)}
    if s.qlora:
        settings["QLORA"] = "1"
    if not s.checkpoint_activations:
        settings["CHECKPOINT_ACTIVATIONS"] = "0"
    elif s.checkpoint_skip_layers:
        settings["CHECKPOINT_SKIP_LAYERS"] = str(s.checkpoint_skip_layers)
    return settings


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def resolve_model(name: str) -> dict:
    if name in MODELS:
        return copy.deepcopy(MODELS[name])
    path = os.path.join(name, "model_config.json") if os.path.isdir(name) else name
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        return plan_config(config)
    raise SystemExit(f"sat-patches plan: unknown model {name!r}: give one of {', '.join(MODELS)} "
                     f"or a checkpoint directory / model_config.json")


def default_seq_len(config: dict) -> int:
    e = config.get("eva_args")
    if not e:
        return 512
    return DEMO_MAX_LENGTH.get(e.get("image_size", [490])[0], config.get("image_length", 256) + 144)
