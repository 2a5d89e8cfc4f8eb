"""Choosing a run's settings: every (model-parallel size, ZeRO stage, offload, micro-batch x accumulation,
checkpointing) combination for a box and a global batch, each with its memory, verdict and predicted step, and the
one to recommend. The global batch is the run's, never the plan's: only how it is split into micro-batches varies."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple, Union

from .memory import GB, Estimate, Setup, estimate
from .shapes import heads
from .timing import MEASURED_FASTER, Card, StepTime, card, step_time

GPU_MARGIN = 0.05              # keep this fraction of the card free
HOST_MARGIN = 0.10
# samples per data-parallel rank and step without a global batch: upstream's finetune_demo/test_config_bf16.json
# (micro-batch 4, no accumulation)
UPSTREAM_RANK_BATCH = 4


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


def _largest(low: int, high: int, ok) -> int:
    """The largest ``n`` in ``[low, high]`` with ``ok(n)`` (``ok`` holds up to some ``n``, then fails), else ``low``."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if ok(middle) else (low, middle - 1)
    return low


def _checkpointing(config: dict, setup: Setup, fits, skip: Optional[int] = None,
                   selective: Union[bool, float] = False) -> List[Setup]:
    """The checkpointing settings worth timing: every layer, the most layers left out that still ``fits`` (only
    ``skip``, where given), and none; with ``selective=True``, also each of those with as many of its checkpointed
    layers as still fit checkpointed selectively (a share given instead: every setting at that share). Memory grows
    with both counts: bisected."""
    layers = config["num_layers"]

    def at(k: int, n: int = 0) -> Setup:
        share = n / (layers - k) if n else 0.0
        return replace(setup, checkpoint_activations=True, checkpoint_skip_layers=k, selective_share=share)
    if skip is None:   # SAT keeps at least one layer checkpointed
        skips = sorted({0, _largest(0, layers - 1, lambda k: fits(at(k)))})
    else:
        skips = [skip]
    if selective is not True:
        out = [replace(at(k), selective_share=float(selective)) for k in skips]
    else:
        out = [at(k) for k in skips]
        out += [at(k, n) for k in skips for n in [_largest(0, layers - k, lambda n: fits(at(k, n)))] if n]
    return out + [replace(setup, checkpoint_activations=False)]


def batch_splits(per_rank: int, micro_batch: Optional[int] = None) -> List[Tuple[int, int]]:
    """The (micro-batch, accumulation) pairs whose product is ``per_rank`` (only ``micro_batch``'s, where given)."""
    return [(m, per_rank // m) for m in range(1, per_rank + 1) if per_rank % m == 0 and micro_batch in (None, m)]


def options(config: dict, gpus: int, gpu_mem_gb: float, host_mem_gb: Optional[float] = None, nodes: int = 1,
            zero: Optional[int] = None, offload: Optional[bool] = None, micro_batch: Optional[int] = None,
            gpu: Optional[Card] = None, checkpoint_skip_layers: Optional[int] = None,
            global_batch: Optional[int] = None, selective: Union[None, bool, float] = None,
            **setup_fields) -> List[Option]:
    """Every (MP, ZeRO, offload, micro-batch x accumulation, checkpointing) combination training ``global_batch``
    samples a step (default: :data:`UPSTREAM_RANK_BATCH` per data-parallel rank; an MP size whose data-parallel
    ranks do not divide it has none), each with its estimate, verdict and predicted step on ``gpu`` (default: the
    card assumed from ``gpu_mem_gb``). ``selective``: search selective checkpointing (True), not (False), or only
    this share of the checkpointed layers (a number); default: searched on a card where it was measured faster."""
    gpu = gpu or card(memory_gb=gpu_mem_gb)[0]
    if selective is None:
        selective = gpu.name in MEASURED_FASTER["selective"]
    setup_fields.setdefault("compiled", gpu.name in MEASURED_FASTER["compiled"] and not selective)
    gpu_bytes = gpu_mem_gb * GB * (1 - GPU_MARGIN)
    mps = model_parallel_sizes(config, gpus * nodes)
    zeros = [zero] if zero is not None else [0, 1, 2]
    offloads = [offload] if offload is not None else [False, True]
    qloras = [setup_fields.pop("qlora")] if "qlora" in setup_fields else [False, True]
    if setup_fields.get("train", "lora") != "lora":
        qloras = [q for q in qloras if not q]  # QLoRA trains the adapters only
    out = []
    for mp, z, off, q in itertools.product(mps, zeros, offloads, qloras):
        if off and z == 0:
            continue  # DeepSpeed offloads the optimizer only under ZeRO
        if q and mp > 1:
            continue  # an NF4 base has no model-parallel forward
        dp = gpus * nodes // mp
        if global_batch and global_batch % dp:
            continue  # its data-parallel ranks cannot share the global batch evenly
        for mb, acc in batch_splits(global_batch // dp if global_batch else UPSTREAM_RANK_BATCH, micro_batch):
            out += _options(config, Setup(gpus=gpus, nodes=nodes, mp=mp, zero=z, offload=off, micro_batch=mb,
                                          accumulation=acc, qlora=q, **setup_fields),
                            gpu, gpu_bytes, host_mem_gb, checkpoint_skip_layers, selective)
    return out


def _options(config: dict, base: Setup, gpu: Card, gpu_bytes: float, host_mem_gb: Optional[float],
             checkpoint_skip_layers: Optional[int], selective: Union[bool, float]) -> List[Option]:
    """``base`` at each checkpointing worth timing (only ``checkpoint_skip_layers``, where given)."""
    out = []
    if not base.checkpoint_activations:
        setups = [base]
    else:
        setups = _checkpointing(config, base, lambda s: estimate(config, s).per_gpu <= gpu_bytes,
                                checkpoint_skip_layers, selective)
        if checkpoint_skip_layers is not None:
            setups = setups[:-1]   # the layers left out are given: checkpointing stays on
    for setup in setups:
        est = estimate(config, setup)
        fits_gpu = est.per_gpu <= gpu_bytes
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
    """The viable option preferring no QLoRA, the smallest MP, no offload, the most tokens/s, then ZeRO-2."""
    viable = [o for o in opts if o.viable]
    return min(viable, key=_preference) if viable else None
