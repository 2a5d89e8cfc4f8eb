"""``sat-patches scripts DEST``: write the drop-in finetune scripts into a CogVLM checkout's ``finetune_demo/``
(the same text as ``finetune_examples/``; the settings are :mod:`sat_patches.runner.finetune_run`'s).
"""
from __future__ import annotations

import os
from typing import Dict, List

from ..core.kinds import KINDS
from ..runner.finetune_run import DEFAULTS, KIND_DEFAULTS

SHARED = ("NUM_GPUS_PER_WORKER", "MP_SIZE", "NNODES", "HOST_FILE", "GLOBAL_BATCH", "MICRO_BATCH", "DS_CONFIG")

TEMPLATE = """#!/usr/bin/env bash
# Drop-in replacement for CogVLM's finetune_demo/finetune_{kind}_lora.sh, with sat_patches applied.
#
# Settings come from the environment; the defaults are upstream's:
#   {shared}
#   {model}
# GLOBAL_BATCH (samples per optimizer step) empty: upstream's, DS_CONFIG's micro-batch x accumulation x
# data-parallel ranks (a resumed run's own). MICRO_BATCH, CHECKPOINT_SKIP_LAYERS empty: the fastest that
# `sat-patches plan` finds fitting the GPUs, else DS_CONFIG's micro-batch and every layer checkpointed;
# gradient accumulation makes up the global batch.
# Several machines: HOST_FILE (DeepSpeed over ssh); or on every node NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
# (torchrun); or srun --ntasks-per-node=1 bash finetune_{kind}.sh (Slurm's variables).
# DS_CONFIG: zero2.json, zero2_offload.json, low_memory.json (installed with sat_patches) or a path.
# QLORA=1: upstream's --use_qlora instead of --use_lora (an NF4 base; needs MP_SIZE=1).
# RESUME=<run directory under SAVE_DIR> continues that run exactly; RESUME_ITERATION=N from its iteration N.
# EVALUATE=1: at the end the trained model answers every VALID_DATA sample (exact match; on by default on CPU).
# SAVE_ADAPTER_ONLY=1/0: saves hold the LoRA adapters only (megabytes; default when only LoRA trains) / the model.
# EXTRA_ARGS="..." adds options; DRY_RUN=1 prints the commands only; --help lists every setting.
# In a CogVLM checkout's finetune_demo/ it runs upstream's finetune_{kind}_demo.py; elsewhere the
# standalone {name} of sat_patches. Without a GPU it trains a tiny {name} on 2 CPU ranks at MP_SIZE=2,
# merges the LoRA and the model-parallel shards into one MP=1 checkpoint and reloads it. In a checkout,
# CPU_RANKS=2 runs the checkout's own demo on 2 CPU ranks: a smoke test before paying for GPUs.
# Example, 2 GPUs with model parallelism:  NUM_GPUS_PER_WORKER=2 MP_SIZE=2 bash finetune_{kind}.sh
export MODEL_KIND={kind}
SCRIPT_DIR="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)" exec python -m sat_patches.runner.finetune_run "$@"
"""


def script_text(kind: str) -> str:
    def settings(names, values):
        return " ".join(f"{n}={values[n]}" for n in names)
    own = KIND_DEFAULTS[kind]
    return TEMPLATE.format(kind=kind, name=KINDS[kind].title, shared=settings(SHARED, DEFAULTS),
                           model=settings(["MODEL_TYPE", "MAX_LENGTH", "LORA_RANK", "TRAIN_ITERS"], own))


def scripts() -> Dict[str, str]:
    return {f"finetune_{kind}.sh": script_text(kind) for kind in KINDS}


def write(dest: str, force: bool = False) -> List[str]:
    """Write the scripts into ``dest``. A different file of the same name is kept unless ``force``."""
    texts = scripts()
    clashes = [name for name, text in texts.items() if os.path.isfile(os.path.join(dest, name))
               and open(os.path.join(dest, name)).read() != text]
    if clashes and not force:
        raise FileExistsError(f"{', '.join(clashes)} already in {dest} with other contents: move them away "
                              f"or pass --force to replace them")
    os.makedirs(dest, exist_ok=True)
    written = []
    for name, text in texts.items():
        path = os.path.join(dest, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.chmod(path + ".tmp", 0o755)
        os.replace(path + ".tmp", path)
        written.append(path)
    return written


def cmd_scripts(args) -> int:
    for path in write(args.dest, args.force):
        print(path)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("scripts", help="write finetune_cogvlm.sh / finetune_cogagent.sh into a directory "
                                       "(a CogVLM checkout's finetune_demo/)")
    p.add_argument("dest", help="where to write them, e.g. CogVLM/finetune_demo")
    p.add_argument("--force", action="store_true", help="replace scripts of the same name with other contents")
    p.set_defaults(func=cmd_scripts)
