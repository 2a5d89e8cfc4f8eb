"""The memory model: what one rank of a run (a :class:`Setup`) holds on its device and on the host.

Weights, gradients and optimizer states by ZeRO stage and offload; activations per kind of layer (checkpointed
layers keep their input, selectively checkpointed ones their matrix products' outputs, SAT's
``checkpoint_skip_layers`` last ones their working set), the logits and loss, and a
fixed runtime share. The host estimate assumes sat_patches; stock SwissArmyTransformer 0.4.12 is shown beside it
(every rank builds in fp32 on the CPU and ``torch.load``s the whole checkpoint: THUDM/CogVLM#283, #320).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List

from ..core import settings
from ..core.kinds import KINDS
from ..cogvlm.shapes import cross_tokens
from .shapes import demo_trainable_parts, lora_parts, model_parts
from .timing import checkpointed_layers, eva_trains, selective_counts

GB = 1e9
GiB = 2 ** 30

# runtime shares (measured on this project's CPU ranks; usual sizes on CUDA)
HOST_BASE_CPU = 0.52 * GiB     # python + torch + SAT + DeepSpeed + gloo, one CPU rank by its first step (ledger, 2 ranks)
HOST_BASE_CUDA = 3.0 * GiB     # the same process with CUDA libraries loaded
GPU_RUNTIME = 1.0 * GiB        # CUDA context, NCCL buffers, allocator slack
# the mapped checkpoint is copied in pieces of this size (checkpoints.sharding.CHUNK_BYTES: the setting's default)
LOAD_CHUNK = settings.SETTINGS["SAT_PATCHES_LOAD_CHUNK_MB"].default * 2 ** 20


@dataclass
class Setup:
    gpus: int = 1                   # GPUs (ranks) per node
    nodes: int = 1
    mp: int = 1
    zero: int = 2
    offload: bool = False
    micro_batch: int = 1
    accumulation: int = 1           # gradient_accumulation_steps: micro-batches per optimizer step
    dtype: str = "bf16"             # bf16 | fp16 | fp32
    seq_len: int = 1288
    lora_rank: int = 10
    lora_eva: bool = True
    train: str = "lora"             # lora | demo (upstream finetune_demo's trainable set)
    checkpoint_activations: bool = True
    checkpoint_skip_layers: int = 0  # the last N language layers not checkpointed (SAT's), the same share of EVA's
    selective_share: float = 0.0    # of each transformer's checkpointed layers, the last ones checkpointed selectively
    compiled: bool = False          # the layers' bodies torch.compile'd (SAT_PATCHES_COMPILE_LAYERS=1)
    qlora: bool = False             # NF4 base (upstream's --use_qlora): MP=1, LoRA on the language model only
    device: str = "cuda"            # cuda | cpu (CPU ranks: everything is host memory)
    reduce_bucket: float = 4e7      # zero_optimization.reduce_bucket_size (upstream's configs)
    allgather_bucket: float = 1e8

    @property
    def dp(self) -> int:
        return max(1, self.gpus * self.nodes // self.mp)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: micro-batch x accumulation x data-parallel ranks."""
        return self.micro_batch * self.accumulation * self.dp

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
    """Values one layer keeps for backward, per token: hidden-size values whole on every model-parallel rank,
    hidden-size values split over the ranks, MLP-width values (split); plus one fp32 log-sum-exp per local head
    (fused attention keeps no score matrix). Measured by ``benchmarks/calibration/layer_bytes.py``."""
    whole: float
    split: float
    ffn: float

    def bytes(self, tokens, hidden, ffn, heads, mp, wb) -> float:
        values = self.whole * hidden + (self.split * hidden + self.ffn * ffn) / mp
        return tokens * wb * values + tokens * heads / mp * 4


# frozen base, LoRA on the attention; a trained EVA MLP (upstream's demo) also keeps its linears' inputs
LANGUAGE_LAYER = LayerKeeps(whole=6, split=6, ffn=3)
EVA_LAYER = LayerKeeps(whole=3, split=6, ffn=1)
EVA_LAYER_MLP_TRAINED = LayerKeeps(whole=4, split=6, ffn=2)
# a selectively checkpointed layer keeps its input and every matrix product's output (measured on meta, as above):
# the language model's qkv, attention, dense and MLP products (LoRA on the attention of the few language tokens);
# EVA's with its LoRA products, more than EVA keeps unchecked (its base is frozen: a product's output is not saved)
LANGUAGE_LAYER_SELECTIVE = LayerKeeps(whole=3, split=4, ffn=2)
EVA_LAYER_SELECTIVE = LayerKeeps(whole=4, split=7, ffn=1)
# upstream's CogAgent demo trains the vision experts and the cross attention: more per vision token (boi + image)
EXPERTS_TRAINED = LayerKeeps(whole=5, split=1, ffn=1)
# a layer of CogAgent's EVA2-CLIP-L encoder when it trains (upstream's demo); plain torch: never split
ENCODER_LAYER = LayerKeeps(whole=10, split=0, ffn=5)


def cross_layer_bytes(c: dict, tokens: int, mp: int, wb: int) -> float:
    """CogAgent's cross attention in one language layer: the encoder's output (whole), keys and values (split),
    the query side at the text length."""
    n = cross_tokens(c)
    inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
    return wb * (n * (c["cross_attn_hidden_size"] + 2 * inner / mp) + tokens * (c["hidden_size"] + 2 * inner / mp))


def cross_layer_bytes_selective(c: dict, tokens: int, mp: int, wb: int) -> float:
    """The cross attention of a selectively checkpointed CogAgent layer: its products' outputs (keys and values of
    the encoder tokens, twice; the query side at the text length)."""
    n = cross_tokens(c)
    inner = c["num_attention_heads"] * c["cross_hidden_size_per_attention_head"]
    return wb * (4 * n * inner / mp + tokens * (2 * c["hidden_size"] + 3 * inner / mp))


def _stack(per_layer: List[float], layer_input: float, checkpointed: int, selective: int = 0,
           selective_keeps: float = 0.0) -> float:
    """Activations of a stack of layers keeping ``per_layer`` each unchecked: the first ``checkpointed`` keep only
    their input, but the last ``selective`` of those keep ``selective_keeps``. The peak: the forward's end, or
    backward recomputing one checkpointed layer's working set (the unchecked layers' freed by then; the selective
    layers' kept outputs too when a fully checkpointed one recomputes)."""
    full = checkpointed - selective
    kept = selective * selective_keeps
    peaks = [sum(per_layer[checkpointed:])]
    if selective:  # what backward saves for a recomputed layer comes beside the outputs it kept
        peaks.append(max(per_layer[full:checkpointed]))
    if full:
        peaks.append(max(per_layer[:full]) - kept)
    return full * layer_input + kept + max(peaks)


def _eva_mlp_trained_layers(c: dict, s: Setup) -> int:
    """EVA layers whose MLP trains: upstream's demo trains CogVLM's layers 46-54 and CogAgent's whole tower."""
    layers = c["eva_args"]["num_layers"]
    if s.train != "demo":
        return 0
    return KINDS["cogagent" if c.get("cross_image_pix") else "cogvlm"].demo_eva_mlp_layers(layers)


def _activations(c: dict, s: Setup, eva_trains: bool) -> Dict[str, float]:
    wb, b, mp, t = s.weight_bytes, s.micro_batch, s.mp, s.seq_len
    language_checkpointed, eva_checkpointed = checkpointed_layers(c, s)
    language_selective, eva_selective = selective_counts(c, s)
    h, f, L = c["hidden_size"], c.get("inner_hidden_size") or 4 * c["hidden_size"], c["num_layers"]
    one = b * LANGUAGE_LAYER.bytes(t, h, f, c["num_attention_heads"], mp, wb)
    selective = b * LANGUAGE_LAYER_SELECTIVE.bytes(t, h, f, c["num_attention_heads"], mp, wb)
    if c.get("cross_image_pix"):
        one += b * cross_layer_bytes(c, t, mp, wb)
        selective += b * cross_layer_bytes_selective(c, t, mp, wb)
        if s.train == "demo":
            one += b * EXPERTS_TRAINED.bytes(c["image_length"] + 1, h, f, 0, mp, wb)
    out = {"activations (language)": _stack([one] * L, b * t * h * wb, language_checkpointed, language_selective,
                                            selective)}
    # the gathered logits on every rank: four fp32 (b, t, vocab) tensors at the loss's peak
    out["logits and loss"] = b * t * c["vocab_size"] * 4 * 4
    e = c.get("eva_args")
    if e:
        et = e["max_sequence_length"]

        def eva_layer(keeps: LayerKeeps) -> float:
            return b * keeps.bytes(et, e["hidden_size"], e["inner_hidden_size"], e["num_attention_heads"], mp, wb)
        trained_mlp = _eva_mlp_trained_layers(c, s)
        layers = ([eva_layer(EVA_LAYER_MLP_TRAINED)] * trained_mlp
                  + [eva_layer(EVA_LAYER)] * (e["num_layers"] - trained_mlp))
        out["activations (EVA)"] = (_stack(layers, b * et * e["hidden_size"] * wb, eva_checkpointed, eva_selective,
                                           eva_layer(EVA_LAYER_SELECTIVE)) if eva_trains else eva_layer(EVA_LAYER))
    if c.get("cross_image_pix"):
        enc, n = c["encoder_args"], cross_tokens(c)
        # the encoder's output; trained (demo), also every encoder layer's values (never checkpointed)
        out["activations (cross branch)"] = b * n * enc["width"] * wb
        if s.train == "demo":
            width = enc["width"]
            layer = ENCODER_LAYER.bytes(n, width, width * enc["mlp_ratio"], width // enc["head_width"], 1, wb)
            out["activations (cross branch)"] += b * enc["layers"] * layer
    return out


# what ``LoraMixin(qlora=True)`` makes NF4; 4 bits a weight, an 8-bit absmax per 64, an fp32 scale per 256 blocks
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
    """Stock SwissArmyTransformer 0.4.12: each rank builds its share in fp32 on the CPU and loads the whole
    checkpoint; at MP>1 node rank 0 also builds the whole model to send partitions."""
    base = HOST_BASE_CUDA if s.device == "cuda" else HOST_BASE_CPU
    checkpoint = 2 * params
    if s.mp == 1:
        return s.gpus * (base + max(4 * params, checkpoint))
    return s.gpus * (base + 4 * params / s.mp) + max(4 * params, 2 * params + checkpoint)
