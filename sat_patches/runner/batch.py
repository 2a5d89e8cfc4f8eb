"""The run's global batch: the samples of one optimizer step, micro-batch x gradient accumulation x data-parallel ranks.

A training setting, never a side effect of memory: upstream's by default (the DeepSpeed config's micro-batch x
accumulation x this run's data-parallel ranks; a resumed run's own), ``GLOBAL_BATCH`` where set. ``MICRO_BATCH``
or the plan choose only how it is split: the accumulation makes up the rest. The DeepSpeed config the run uses is
a copy holding all three (DeepSpeed checks that they agree).
"""
from __future__ import annotations

import ast
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

ARGUMENTS_TXT = "arguments.txt"  # what a run's ranks were given, written by sat_patches.diagnostics.console


@dataclass(frozen=True)
class Batch:
    size: int             # the global batch
    micro: int
    accumulation: int
    dp: int               # data-parallel ranks
    source: str           # whose size it is

    def line(self) -> str:
        return (f"global batch {self.size} = micro-batch {self.micro} x accumulation {self.accumulation} x {self.dp} "
                f"data-parallel rank{'s' if self.dp != 1 else ''} ({self.source})")


def config_name(env: Dict[str, str]) -> str:
    """The DeepSpeed config a run starts from: CPU ranks always use ``cpu_demo.json``."""
    return "cpu_demo.json" if env.get("CPU_RANKS") not in (None, "", "0") else env.get("DS_CONFIG") or "zero2.json"


def ranks_per_node(env: Dict[str, str]) -> int:
    return int(env["CPU_RANKS"]) if env.get("CPU_RANKS") not in (None, "", "0") else int(env["NUM_GPUS_PER_WORKER"])


def data_parallel(env: Dict[str, str]) -> int:
    return ranks_per_node(env) * int(env.get("NNODES") or 1) // int(env.get("MP_SIZE") or 1)


def resumed(run_dir: str) -> Optional[int]:
    """The global batch the run saved in ``run_dir`` trained with (its ``arguments.txt``); None where it does not
    say."""
    names = ("batch_size", "gradient_accumulation_steps", "world_size", "model_parallel_size")
    found = {}
    try:
        with open(os.path.join(run_dir, ARGUMENTS_TXT)) as f:
            for line in f:
                name, _, value = line.partition(" = ")
                if name in names:
                    found[name] = ast.literal_eval(value.strip())
    except (OSError, ValueError, SyntaxError):
        return None
    micro, accumulation, world, mp = (found.get(n) for n in names)
    if not all(isinstance(v, int) and v > 0 for v in (micro, world, mp)):
        return None
    return micro * (accumulation or 1) * (world // mp)


def global_batch(env: Dict[str, str], config: dict, name: str) -> Tuple[int, str]:
    """The run's global batch and whose it is: ``GLOBAL_BATCH``, else a resumed run's, else the config's
    ``train_batch_size``, else its micro-batch x accumulation x this run's data-parallel ranks."""
    if env.get("GLOBAL_BATCH"):
        return int(env["GLOBAL_BATCH"]), "GLOBAL_BATCH"
    size = resumed(env["RESUME"]) if env.get("RESUME") else None
    if size:
        return size, "the resumed run's"
    owner = "upstream's" if name in ("zero2.json", "zero2_offload.json", "low_memory.json") else f"{name}'s"
    if config.get("train_batch_size"):
        return int(config["train_batch_size"]), f"{owner} train_batch_size"
    micro, accumulation = config_split(config)
    return micro * accumulation * data_parallel(env), owner


def config_split(config: dict) -> Tuple[int, int]:
    return int(config.get("train_micro_batch_size_per_gpu") or 1), int(config.get("gradient_accumulation_steps") or 1)


def errors(env: Dict[str, str], config: dict, name: str) -> List[str]:
    """A global batch the data-parallel ranks do not share evenly; a ``MICRO_BATCH`` that does not divide a rank's
    share. Each with what to set."""
    size, source = global_batch(env, config, name)
    dp, mp = data_parallel(env), env.get("MP_SIZE") or "1"
    ranks = f"{dp * int(mp)} ranks / MP_SIZE={mp}"
    if size % dp:
        multiples = ", ".join(str(dp * k) for k in range(1, 4))
        setting = f"GLOBAL_BATCH={size}" if source == "GLOBAL_BATCH" else f"the global batch {size} ({source})"
        return [f"{setting} is not a multiple of the {dp} data-parallel ranks ({ranks}): set GLOBAL_BATCH to a "
                f"multiple of {dp} ({multiples}, ...), or change MP_SIZE or the number of ranks."]
    micro, per_rank = env.get("MICRO_BATCH"), size // dp
    if micro and micro.isdigit() and int(micro) and per_rank % int(micro):
        fits = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        return [f"MICRO_BATCH={micro} does not divide the {per_rank} samples each data-parallel rank takes per step "
                f"(global batch {size} ({source}) / {dp} ranks): set MICRO_BATCH to one of {fits} (gradient "
                f"accumulation makes up the rest), or GLOBAL_BATCH to a multiple of {int(micro) * dp}."]
    return []


def split(env: Dict[str, str], config: dict, name: str, planned_micro: Optional[int] = None) -> Batch:
    """The run's global batch split into micro-batch x accumulation: ``MICRO_BATCH``, else the plan's micro-batch,
    else the largest divisor of a rank's share up to the config's micro-batch."""
    size, source = global_batch(env, config, name)
    dp = data_parallel(env)
    per_rank = size // dp
    if env.get("MICRO_BATCH"):
        micro = int(env["MICRO_BATCH"])
    elif planned_micro:
        micro = planned_micro
    else:
        micro = max(m for m in range(1, min(per_rank, config_split(config)[0]) + 1) if per_rank % m == 0)
    return Batch(size, micro, per_rank // micro, dp, source)


def write_config(config: dict, source: str, batch: Batch, save_dir: str) -> str:
    """A copy of the DeepSpeed config ``config`` (read from ``source``) with ``batch``'s three sizes, beside the
    run's checkpoints. ZeRO-1/2 optimizer shards are saved elastic (DeepSpeed's ``elastic_checkpoint``): a resumed
    run may have another number of data-parallel ranks, as long as its global batch is the same."""
    config = dict(config, train_batch_size=batch.size, train_micro_batch_size_per_gpu=batch.micro,
                  gradient_accumulation_steps=batch.accumulation)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") in (1, 2):
        config["zero_optimization"] = dict({"elastic_checkpoint": True}, **zero)
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.abspath(os.path.join(save_dir, f"{stem}.global_batch{batch.size}.micro_batch{batch.micro}"
                                        f".accumulation{batch.accumulation}.json"))
    os.makedirs(save_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=save_dir, suffix=".tmp")  # every node may write it into a shared folder
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, path)
    return path
