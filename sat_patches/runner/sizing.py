"""The run's sizes: its global batch (:mod:`.batch`) split into micro-batch x gradient accumulation, and its
checkpointing, as ``sat-patches plan`` recommends them for the GPUs this node has (nvidia-smi), else as the DeepSpeed
config says; the DeepSpeed config the run uses, holding them."""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..cli.plan import checkpointing
from ..core import settings
from ..planning import search, shapes
from ..planning.memory import Setup
from . import batch
from .batch import Batch
from .finetune_check import config_path

SELECTIVE = "SAT_PATCHES_CHECKPOINT_SELECTIVE"   # the user's share, else the plan's (its levers: realise.lever_settings)


def gpu_memory_gb() -> Optional[float]:
    """Memory of this node's smallest GPU (nvidia-smi), None where it cannot be read."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    sizes = [float(x) for x in out.stdout.split() if x.replace(".", "", 1).isdigit()]
    return min(sizes) / 1024 if out.returncode == 0 and sizes else None


def read_config(name: str) -> dict:
    with open(config_path(name)) as f:
        return json.load(f)


class PlanError(Exception):
    """Nothing the plan knows fits the GPUs at the run's settings."""


@dataclass
class RunPlan:
    batch: Batch                # the global batch and its split
    setup: Optional[Setup]      # the plan's choice (its checkpointing too); None where the plan cannot tell
    why: str                    # how the micro-batch was chosen


def planned(env: Dict[str, str], config: dict, size: int) -> Tuple[Optional[search.Option], str]:
    """What ``sat-patches plan`` recommends for this run's global batch ``size`` on the detected GPUs, at its
    ``MP_SIZE``, ZeRO stage and offload (and ``MICRO_BATCH`` where set), and why there is none where it cannot
    tell. Raises :class:`PlanError` where nothing fits and the micro-batch is the plan's to choose."""
    memory = gpu_memory_gb()
    if memory is None:
        return None, "no GPU memory figure from nvidia-smi to plan with"
    try:
        model = shapes.resolve_model(env["MODEL_TYPE"])
    except SystemExit:  # a model the plan does not know: the config's micro-batch, every layer checkpointed
        return None, f"the plan does not know MODEL_TYPE={env['MODEL_TYPE']}"
    zero = config.get("zero_optimization", {})
    given = {k: int(env[k]) for k in ("MICRO_BATCH", "CHECKPOINT_SKIP_LAYERS") if env.get(k)}
    gpus, nodes, mp = (int(env[k]) for k in ("NUM_GPUS_PER_WORKER", "NNODES", "MP_SIZE"))
    qlora = env.get("QLORA") == "1"
    opts = search.options(model, gpus, memory, nodes=nodes, zero=zero.get("stage", 0), global_batch=size,
                          offload="offload_optimizer" in zero, micro_batch=given.get("MICRO_BATCH"),
                          checkpoint_skip_layers=given.get("CHECKPOINT_SKIP_LAYERS"), seq_len=int(env["MAX_LENGTH"]),
                          lora_rank=int(env["LORA_RANK"]), train=env["TRAINABLE"],
                          checkpoint_activations=env.get("CHECKPOINT_ACTIVATIONS") == "1",
                          selective=settings.read(SELECTIVE, env) if env.get(SELECTIVE) else None)
    best = search.recommend([o for o in opts if o.estimate.setup.mp == mp and o.estimate.setup.qlora == qlora])
    if best:
        return best, (f"the fastest that fits {gpus} x {memory:g} GB at MP_SIZE={mp} by the plan "
                      f"({best.estimate.per_gpu / 1e9:.1f} GB per GPU, {best.time.tokens_per_s:.0f} tokens/s "
                      f"predicted), checkpointing {checkpointing(best.estimate.setup, model['num_layers'])}")
    if "MICRO_BATCH" in given:
        return None, f"nothing fits {gpus} x {memory:g} GB by the plan's estimate"
    fit = [o.estimate.setup for o in opts if o.viable]
    ways = [f"MP_SIZE={m}" for m in sorted({s.mp for s in fit if not s.qlora}) if m != mp]
    ways += ["QLORA=1"] if not qlora and any(s.qlora for s in fit) else []
    raise PlanError(f"nothing fits {nodes * gpus} x {memory:g} GB GPUs at MP_SIZE={mp}"
                    f"{' with QLORA=1' if qlora else ''}, not even micro-batch 1 with every layer checkpointed (global batch {size}; sat-patches plan "
                    f"--model {env['MODEL_TYPE']} --gpus {gpus} --gpu-mem {memory:g} shows the memory): set "
                    + ", or ".join(ways + ["more GPUs (a larger MP_SIZE) or cards with more memory"]) + ".")


def run_plan(env: Dict[str, str]) -> RunPlan:
    """The run's global batch, its split, and the plan's checkpointing (GPU runs)."""
    name = batch.config_name(env)
    config = read_config(name)
    size, _ = batch.global_batch(env, config, name)
    on_gpu = env.get("CPU_RANKS") in (None, "", "0")
    option, why = planned(env, config, size) if on_gpu else (None, "")
    setup = option.estimate.setup if option else None
    chosen = batch.split(env, config, name, setup and setup.micro_batch)
    own = batch.config_split(config)[0]
    if env.get("MICRO_BATCH"):
        why = "MICRO_BATCH" + (f"; the plan: {why}" if why else "")
    elif not option:
        why = (f"{name}'s" if chosen.micro == own else f"the largest up to {name}'s {own} that divides a rank's "
               f"{chosen.micro * chosen.accumulation}") + (f" ({why})" if why else "")
    return RunPlan(chosen, setup, f"micro-batch {chosen.micro} x accumulation {chosen.accumulation}: {why}")


def run_config(env: Dict[str, str], name: str, save_dir: str, chosen: Batch) -> str:
    """The DeepSpeed config the run uses: SAT takes the micro-batch and the accumulation from it, so ``chosen``'s
    sizes go into a copy saved beside the run's checkpoints."""
    return batch.write_config(read_config(name), config_path(name), chosen, save_dir)
