"""Checks the finetune scripts run before launching: one clear message, with the fix, per problem
(``python -m sat_patches.runner.finetune_check`` reads the scripts' environment variables).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import List, Optional

from ..cogvlm.config import tiny_config
from ..core import settings
from ..core.kinds import NAMES
from ..cogvlm.shapes import RELEASED, upstream_config
from ..data.jsonl import check_data_path
from . import batch, cluster


def _int(env: dict, name: str, default: Optional[int], errors: List[str], minimum: int = 1) -> Optional[int]:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        errors.append(f"{name}={raw!r} is not a whole number: set {name} to a positive integer, e.g. {name}={default or 1}.")
        return None
    if value < minimum:
        errors.append(f"{name}={value} must be at least {minimum}: set {name}={default or minimum} or larger.")
        return None
    return value


# DeepSpeed configs installed with the package (a wheel carries nothing outside sat_patches/)
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def config_path(name: str) -> Optional[str]:
    """``DS_CONFIG``: a file that exists (absolute, or relative to the working directory) wins, else one of
    the configs installed with sat_patches; None when it is neither."""
    if os.path.isfile(name):
        return os.path.abspath(name)
    path = os.path.join(CONFIGS, name)
    return path if os.path.isfile(path) else None


def visible_gpus(env: dict) -> int:
    """GPUs this node can use: CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return 0


def model_heads(env: dict) -> Optional[int]:
    """Attention heads (MP_SIZE must divide them): the checkpoint's, else the released or tiny model's."""
    source = env.get("FROM_PRETRAINED") or env.get("MODEL_TYPE", "")
    config = os.path.join(source, "model_config.json")
    if source and os.path.isfile(config):
        with open(config) as f:
            return json.load(f).get("num_attention_heads")
    heads = {name: upstream_config(name)["num_attention_heads"] for name in RELEASED}
    heads.update({f"tiny-{kind}": tiny_config(kind)["num_attention_heads"] for kind in NAMES})
    return heads.get(os.path.basename(source.rstrip("/")))


def in_checkout(env: dict) -> Optional[str]:
    """The path of the checkout's demo when the script sits in a CogVLM checkout's ``finetune_demo/``."""
    kind = env.get("MODEL_KIND", "cogvlm")
    demo = os.path.join(env.get("SCRIPT_DIR") or "", f"finetune_{kind}_demo.py")
    return demo if env.get("SCRIPT_DIR") and os.path.isfile(demo) else None


def no_gpu_message(env: dict, per_node: int, visible: Optional[int]) -> str:
    """One message for a GPU run without a GPU: both ways out, and nothing that contradicts them."""
    kind = env.get("MODEL_KIND", "cogvlm")
    script = f"finetune_{kind}.sh"
    demo = in_checkout(env)
    cpu_run = (f"this checkout's finetune_demo/{os.path.basename(demo)} trains a tiny {kind} for a few steps"
               if demo else f"a tiny {kind} trains") + " on 2 CPU ranks at MP_SIZE=2, saves and merges the LoRA"
    if per_node == 0 and visible:
        return (f"NUM_GPUS_PER_WORKER=0 asks for no GPU: set NUM_GPUS_PER_WORKER to the number of GPUs to use "
                f"(this node has {visible}), or, to run on CPU ranks instead, run CPU_RANKS=2 bash {script} "
                f"({cpu_run}).")
    where = "CUDA_VISIBLE_DEVICES lists none" if env.get("CUDA_VISIBLE_DEVICES") is not None else \
        "nvidia-smi lists none" if shutil.which("nvidia-smi") else "no nvidia-smi, no CUDA driver"
    return (f"no GPU is visible on this node ({where}), so this GPU run cannot start. Either make the GPUs "
            f"visible (install the driver, check nvidia-smi, set CUDA_VISIBLE_DEVICES) and set NUM_GPUS_PER_WORKER "
            f"to how many to use, or run on CPU ranks instead: CPU_RANKS=2 bash {script} ({cpu_run}).")


def resume_errors(env: dict) -> List[str]:
    """``RESUME`` names a run directory (it holds ``latest``); ``RESUME_ITERATION`` one of its saved iterations."""
    run, iteration = env.get("RESUME", ""), env.get("RESUME_ITERATION", "")
    if not run:
        return ["RESUME_ITERATION needs RESUME=<the run directory to continue> (a directory under SAVE_DIR)."] \
            if iteration else []
    if not os.path.isfile(os.path.join(run, "latest")):
        return [f"RESUME={run} is not a directory of saved iterations (it has no 'latest'): set RESUME to the "
                f"directory a run saved into (under SAVE_DIR)."]
    if iteration and not (iteration.isdigit() and os.path.isdir(os.path.join(run, iteration))):
        saved = sorted(int(d) for d in os.listdir(run) if d.isdigit())
        return [f"RESUME_ITERATION={iteration}: {run} holds iterations {', '.join(map(str, saved)) or 'none'}: "
                f"set RESUME_ITERATION to one of them, or unset it to continue from 'latest'."]
    return []


def data_errors(env: dict) -> List[str]:
    """``TRAIN_DATA`` and ``VALID_DATA`` usable before launch (an empty data set stops SAT with a
    ZeroDivisionError, THUDM/CogVLM#509)."""
    return [f"{name}={env[name]}: {problem}" for name in ("TRAIN_DATA", "VALID_DATA") if env.get(name)
            for problem in check_data_path(env[name])]


def _gpus_per_rank_errors(env: dict, per_node: int, visible: Optional[int]) -> List[str]:
    """A GPU each, or, in the shared-GPU debugging mode (``SAT_PATCHES_SHARED_GPU=1``), fewer GPUs than ranks."""
    try:
        shared = settings.read("SAT_PATCHES_SHARED_GPU", env)
    except settings.SettingError as exc:
        return [str(exc)]
    if shared and per_node <= visible:
        return [f"SAT_PATCHES_SHARED_GPU=1 lets several ranks share a GPU, but NUM_GPUS_PER_WORKER={per_node} ranks "
                f"on {visible} visible GPU(s) have a card each: unset SAT_PATCHES_SHARED_GPU (a debugging mode: its "
                f"collectives go through host copies) and the ranks use NCCL."]
    if not shared and per_node > visible:
        return [f"NUM_GPUS_PER_WORKER={per_node} but this node has {visible} visible GPU(s): set "
                f"NUM_GPUS_PER_WORKER={visible} (or make more GPUs visible via CUDA_VISIBLE_DEVICES; to debug "
                f"several ranks on one GPU, SAT_PATCHES_SHARED_GPU=1)."]
    return []


def batch_errors(env: dict) -> List[str]:
    """The global batch against the data-parallel ranks (:mod:`.batch`), from the config the run starts from."""
    name = batch.config_name(env)
    try:
        with open(config_path(name)) as f:
            config = json.load(f)
    except ValueError:
        return []  # named by the DeepSpeed config's own check, in the ranks
    return batch.errors(env, config if isinstance(config, dict) else {}, name)


def check(env: dict) -> List[str]:
    errors: List[str] = []
    cpu = env.get("CPU_RANKS") not in (None, "", "0")
    if cpu:
        per_node = _int(env, "CPU_RANKS", 2, errors)
    else:
        per_node = _int(env, "NUM_GPUS_PER_WORKER", 8, errors, minimum=0)
        visible = visible_gpus(env) if per_node is not None else None
        if per_node == 0 or visible == 0:
            return errors + [no_gpu_message(env, per_node, visible)]
    mp = _int(env, "MP_SIZE", 1, errors)
    nnodes = _int(env, "NNODES", 1, errors)
    sizes_ok = None not in (_int(env, "MICRO_BATCH", 0, errors), _int(env, "GLOBAL_BATCH", 0, errors))
    _int(env, "CHECKPOINT_SKIP_LAYERS", None, errors, minimum=0)
    if None in (per_node, mp, nnodes):
        return errors
    world = per_node * nnodes
    unit = "CPU_RANKS" if cpu else "NUM_GPUS_PER_WORKER"
    errors += cluster.slurm_errors(env) + cluster.node_errors(env, nnodes, per_node, mp, unit)
    if world % mp:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        errors.append(f"MP_SIZE={mp} does not divide the world size {world} ({unit}={per_node} x NNODES={nnodes}): "
                      f"set MP_SIZE to one of {fits}, or change {unit}.")
    elif sizes_ok and config_path(batch.config_name(env)):
        errors += batch_errors(env)
    heads = model_heads(env)
    if heads and heads % mp:
        fits = [d for d in range(1, heads + 1) if heads % d == 0 and d <= max(world, 1)]
        errors.append(f"MP_SIZE={mp} does not divide the {heads} attention heads of {env.get('MODEL_TYPE')}: "
                      f"set MP_SIZE to one of {fits}.")
    if not cpu:
        errors += _gpus_per_rank_errors(env, per_node, visible)
    lws = env.get("LOCAL_WORLD_SIZE")
    if lws not in (None, "") and lws != str(per_node):
        errors.append(f"LOCAL_WORLD_SIZE={lws} but each node runs {per_node} ranks ({unit}): SAT would build no "
                      f"node groups and model-parallel loading fails ('node group is not initialized'). Unset "
                      f"LOCAL_WORLD_SIZE or set LOCAL_WORLD_SIZE={per_node} (also in .deepspeed_env).")
    if env.get("TRAINABLE") not in (None, "", "lora", "demo"):
        errors.append(f"TRAINABLE={env['TRAINABLE']!r}: set TRAINABLE=lora (the adapters only) or TRAINABLE=demo "
                      f"(what the demo script trains), or leave it unset.")
    if env.get("QLORA") not in (None, "", "0", "1"):
        errors.append(f"QLORA={env['QLORA']!r}: set QLORA=1 (upstream's --use_qlora: an NF4 base) or QLORA=0.")
    elif env.get("QLORA") == "1" and env.get("MP_SIZE", "1") not in ("", "1"):
        errors.append(f"QLORA=1 with MP_SIZE={env['MP_SIZE']}: an NF4 base layer has no model-parallel forward; set "
                      f"MP_SIZE=1 (QLoRA runs data-parallel on one or more GPUs).")
    ds_config = env.get("DS_CONFIG")
    if ds_config and config_path(ds_config) is None:
        shipped = sorted(n for n in os.listdir(CONFIGS) if n.endswith(".json") and n != "cpu_demo.json")
        errors.append(f"DS_CONFIG={ds_config} is neither a file nor one of the configs installed with sat_patches: "
                      f"set DS_CONFIG to one of {', '.join(shipped)} or to the path of your own DeepSpeed config.")
    errors += resume_errors(env)
    if env.get("SAVE_ADAPTER_ONLY") not in (None, "", "0", "1"):
        errors.append(f"SAVE_ADAPTER_ONLY={env['SAVE_ADAPTER_ONLY']!r}: set 1 (saves hold the LoRA adapters), 0 (the "
                      f"whole model) or leave it empty (adapters when only LoRA trains).")
    if env.get("EVALUATE") not in (None, "", "0", "1"):
        errors.append(f"EVALUATE={env['EVALUATE']!r}: set EVALUATE=1 (answer every validation sample after "
                      f"training) or EVALUATE=0.")
    elif env.get("EVALUATE") == "1" and in_checkout(env):
        errors.append("EVALUATE=1 runs in sat_patches' own trainer, not in the checkout's demo: unset it and run "
                      "python -m sat_patches evaluate <the run's checkpoint> <VALID_DATA> --local_tokenizer ... "
                      "after training.")
    hostfile = env.get("HOST_FILE")
    if hostfile and not os.path.isfile(hostfile):
        errors.append(f"HOST_FILE={hostfile} does not exist: create it (lines 'host slots=N') or unset HOST_FILE "
                      f"for a single node.")
    return errors


def main(env=None) -> int:
    errors = check(dict(os.environ) if env is None else env)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
