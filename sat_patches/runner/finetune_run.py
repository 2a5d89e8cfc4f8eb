"""What ``finetune_examples/finetune_cog{vlm,agent}.sh`` run, from their environment variables.

Four modes, chosen in this order:
- checkout, CPU ranks (the script sits in a CogVLM checkout's ``finetune_demo/`` and ``CPU_RANKS`` is
  set): a smoke test of that checkout's own, unchanged demo before paying for GPUs. A tiny checkpoint
  built with the checkout's ``utils.models`` classes, a local tokenizer and CAPTCHA images are made
  under ``WORK_DIR``; the demo trains a few steps on ``CPU_RANKS`` ranks at ``MP_SIZE`` (gloo; torchrun
  starts them) through ``sat_patches.launch``, saves every model-parallel shard, merges its LoRA and saves the
  merged model as upstream's demo does; then the shards are checked and the merged model is reloaded;
- checkout: that demo runs through ``sat_patches.launch`` under DeepSpeed on GPUs, with upstream's
  options (no GPU and no ``CPU_RANKS``: one message naming both ways out);
- GPU standalone: GPUs are visible: our ``sat_patches finetune train`` runs under DeepSpeed on
  ``FROM_PRETRAINED`` (upstream's model names or a local SAT checkpoint);
- CPU demo (no GPU, or ``CPU_RANKS`` set): a tiny randomly initialised model of the same architecture
  on generated coloured shapes, trained on ``CPU_RANKS`` ranks at ``MP_SIZE``, then merged (LoRA and MP)
  and reloaded.

On CPU ranks (both CPU modes) the user's ``TRAIN_DATA`` / ``VALID_DATA`` are used when given (checked
before launch, as on GPUs), and ``TRAIN_ITERS``; each setting a CPU run cannot honour is named, with why.

``DRY_RUN=1`` prints the commands instead of running them.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

from ..cogvlm.config import tiny_config
from ..cogvlm.scores import read_summary, summary_line
from ..core.kinds import KINDS
from ..core.ports import free_port
from ..planning import realise, search, shapes
from ..planning.memory import Setup
from . import steps
from .finetune_check import check, config_path, data_errors, visible_gpus

# upstream's finetune_demo/finetune_cog{vlm,agent}_lora.sh values (NUM_GPUS_PER_WORKER=8 there too)
DEFAULTS = {
    "NUM_GPUS_PER_WORKER": "8", "MP_SIZE": "1", "NNODES": "1", "HOST_FILE": "", "VERSION": "base",
    "TOKENIZER": "lmsys/vicuna-7b-v1.5", "TRAIN_DATA": "./archive_split/train", "VALID_DATA": "./archive_split/valid",
    "SAVE_DIR": "./checkpoints", "SAVE_INTERVAL": "200", "EVAL_INTERVAL": "200", "LOG_INTERVAL": "50",
    "SEED": "2023", "DS_CONFIG": "zero2.json", "LAYER_RANGE": "", "CHECKPOINT_ACTIVATIONS": "1",
    "MICRO_BATCH": "",  # empty: the plan's choice for the detected GPUs, else DS_CONFIG's
    "CHECKPOINT_SKIP_LAYERS": "",  # the last N language layers not checkpointed; empty: the plan's choice, else 0
    "TRAINABLE": "",    # lora (adapters only) or demo (what the demo trains); empty: demo in a checkout, else lora
    "QLORA": "0",       # 1: upstream's --use_qlora (an NF4 base, MP_SIZE=1) instead of --use_lora
    "RESUME": "",       # a run directory a previous run saved into: continue it (--mode pretrain --load)
    "RESUME_ITERATION": "",  # with RESUME: continue from this saved iteration instead of 'latest'
    "EVALUATE": "0",    # 1: the trained checkpoint answers every VALID_DATA sample (python -m sat_patches evaluate)
    "SAVE_ADAPTER_ONLY": "",  # 1: saves hold the LoRA adapters and name the base; 0: the whole model; empty: 1 when
                              # only LoRA trains on a loaded base
}
KIND_DEFAULTS = {
    "cogvlm": {"MODEL_TYPE": KINDS["cogvlm"].released, "MAX_LENGTH": "1288", "LORA_RANK": "10", "TRAIN_ITERS": "800"},
    "cogagent": {"MODEL_TYPE": KINDS["cogagent"].released, "VERSION": "chat", "MAX_LENGTH": "400", "LORA_RANK": "50",
                 "TRAIN_ITERS": "2000"},
}
# no GPU: the tiny CPU demo (2 ranks at MP=2, a short run)
CPU_DEFAULTS = {"CPU_RANKS": "2", "MP_SIZE": "2", "TRAIN_ITERS": "50", "MAX_LENGTH": "120", "LORA_RANK": "4",
                "EVALUATE": "1", "TRAIN_DATA": "", "VALID_DATA": "",  # empty: the generated demo data; else the user's
                "DEMO_TRAIN_SAMPLES": "96", "DEMO_VALID_SAMPLES": "16",
                "SAVE_INTERVAL": "50", "EVAL_INTERVAL": "100000", "LOG_INTERVAL": "5",
                "CHECKPOINT_ACTIVATIONS": "0"}
# a CogVLM checkout's demo on CPU ranks: a few steps are enough to train, save and merge
CHECKOUT_CPU_DEFAULTS = {**CPU_DEFAULTS, "TRAIN_ITERS": "4", "SAVE_INTERVAL": "20", "LOG_INTERVAL": "1",
                         "EVALUATE": "0"}


def settings(environ: Dict[str, str]) -> Dict[str, str]:
    """The run's settings: the environment over the mode's defaults over upstream's."""
    kind = environ.get("MODEL_KIND", "cogvlm")
    if kind not in KIND_DEFAULTS:
        raise SystemExit(f"error: MODEL_KIND={kind!r}: use cogvlm or cogagent")
    env = {**DEFAULTS, **KIND_DEFAULTS[kind], "MODEL_KIND": kind}
    run_mode = mode({**env, **environ})
    if run_mode == "cpu":
        env.update(CPU_DEFAULTS, MODEL_TYPE=f"tiny-{kind}", WORK_DIR=os.path.abspath(f"sat_patches_demo/{kind}"))
    elif run_mode == "checkout-cpu":
        env.update(CHECKOUT_CPU_DEFAULTS, MODEL_TYPE=f"tiny-{kind}",
                   WORK_DIR=os.path.abspath(f"sat_patches_demo/checkout-{kind}"))
    env.update({k: v for k, v in environ.items() if v != "" or k not in env})
    if run_mode in ("cpu", "checkout-cpu"):  # the user's data, from where they gave it (the checkout run changes folder)
        env.update({k: os.path.abspath(env[k]) for k in ("TRAIN_DATA", "VALID_DATA") if env.get(k)})
        tiny = int(tiny_config(kind)["max_sequence_length"])  # the tiny model's positions
        if env["MAX_LENGTH"].isdigit() and int(env["MAX_LENGTH"]) > tiny:
            env["MAX_LENGTH"] = str(tiny)  # said by cpu_notes
    if env.get("QLORA") == "1" and not environ.get("MP_SIZE"):
        env["MP_SIZE"] = "1"  # an NF4 base: data parallelism only (the CPU runs' MP_SIZE=2 default does not apply)
    if not env.get("TRAINABLE"):
        env["TRAINABLE"] = "demo" if run_mode.startswith("checkout") else "lora"  # a checkout: its demo's choice
    env["SAT_PATCHES_TRAINABLE"] = env["TRAINABLE"]  # read by the ranks (sat_patches.runtime.trainable)
    env["SAT_PATCHES_SAVE_ADAPTER_ONLY"] = env["SAVE_ADAPTER_ONLY"]  # (sat_patches.checkpoints.adapter)
    return env


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


def planned(env: Dict[str, str], config: dict) -> Optional[Setup]:
    """The setting ``sat-patches plan`` recommends for this run on the detected GPUs, at its ``MP_SIZE``, ZeRO
    stage and offload; None where the plan cannot tell."""
    memory = gpu_memory_gb()
    if memory is None:
        return None
    try:
        model = shapes.resolve_model(env["MODEL_TYPE"])
    except SystemExit:  # a model the plan does not know: the config's micro-batch, every layer checkpointed
        return None
    zero = config.get("zero_optimization", {})
    given = {k: int(env[k]) for k in ("MICRO_BATCH", "CHECKPOINT_SKIP_LAYERS") if env.get(k)}
    opts = search.options(model, int(env["NUM_GPUS_PER_WORKER"]), memory, nodes=int(env["NNODES"]),
                        zero=zero.get("stage", 0), offload="offload_optimizer" in zero,
                        micro_batch=given.get("MICRO_BATCH"), checkpoint_skip_layers=given.get("CHECKPOINT_SKIP_LAYERS"),
                        seq_len=int(env["MAX_LENGTH"]), lora_rank=int(env["LORA_RANK"]), train=env["TRAINABLE"],
                        qlora=env.get("QLORA") == "1", checkpoint_activations=env.get("CHECKPOINT_ACTIVATIONS") == "1")
    best = search.recommend([o for o in opts if o.estimate.setup.mp == int(env["MP_SIZE"])])
    return best.estimate.setup if best else None


def run_config(env: Dict[str, str], name: str, save_dir: str, choice: Optional[Setup] = None) -> str:
    """The DeepSpeed config the run uses: SAT takes the micro-batch from it, so ``MICRO_BATCH`` (default: the
    plan's ``choice``) goes into a copy saved beside the run's checkpoints."""
    source = config_path(name)
    config = read_config(name)
    micro = int(env["MICRO_BATCH"]) if env.get("MICRO_BATCH") else choice and choice.micro_batch
    if micro is None or micro == config.get("train_micro_batch_size_per_gpu"):
        return source
    config["train_micro_batch_size_per_gpu"] = micro
    config.pop("train_batch_size", None)  # DeepSpeed derives it from the micro-batch and the world size
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.abspath(os.path.join(save_dir, f"{stem}.micro_batch{micro}.json"))
    os.makedirs(save_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(path + ".tmp", path)
    return path


def mode(env: Dict[str, str]) -> str:
    cpu_ranks, demo = env.get("CPU_RANKS") not in (None, "", "0"), KINDS[env["MODEL_KIND"]].upstream_demo
    if env.get("SCRIPT_DIR") and os.path.isfile(os.path.join(env["SCRIPT_DIR"], demo)):
        return "checkout-cpu" if cpu_ranks else "checkout"
    return "gpu" if not cpu_ranks and visible_gpus(env) > 0 else "cpu"


def evaluation_dir(save_dir: str, before: bool = False) -> str:
    """Where ``EVALUATE=1`` writes its results (``before``: the untrained model's)."""
    return os.path.join(save_dir, "evaluation_before_training" if before else "evaluation")


def train_options(env: Dict[str, str], **paths) -> List[str]:
    """Upstream's ``gpt_options`` and ``MODEL_ARGS``, with the scripts' settings filled in."""
    choice = None if paths.get("ds_config") else planned(env, read_config(env["DS_CONFIG"]))
    opts = [
        "--experiment-name", f"finetune-{os.path.basename(env['MODEL_TYPE'].rstrip('/'))}",
        "--model-parallel-size", env["MP_SIZE"], "--mode", "finetune", "--train-iters", env["TRAIN_ITERS"],
        "--resume-dataloader", "--from_pretrained", paths.get("model", env["MODEL_TYPE"]),
        "--max_length", env["MAX_LENGTH"], "--lora_rank", env["LORA_RANK"],
        "--use_qlora" if env.get("QLORA") == "1" else "--use_lora",  # upstream's demo takes one of the two
        "--local_tokenizer", paths.get("tokenizer", env["TOKENIZER"]), "--version", env["VERSION"],
        "--train-data", paths.get("train", env["TRAIN_DATA"]), "--valid-data", paths.get("valid", env["VALID_DATA"]),
        "--distributed-backend", "nccl", "--lr-decay-style", "cosine", "--warmup", ".02",
        "--save-interval", env["SAVE_INTERVAL"], "--eval-interval", env["EVAL_INTERVAL"],
        "--save", paths.get("save", env["SAVE_DIR"]), "--eval-iters", "10", "--eval-batch-size", "1",
        "--split", "1.", "--deepspeed_config",
        paths.get("ds_config") or run_config(env, env["DS_CONFIG"], paths.get("save", env["SAVE_DIR"]), choice),
        "--seed", env["SEED"], "--log-interval", env["LOG_INTERVAL"],
    ]
    if env.get("RESUME"):  # continue that run (from RESUME_ITERATION where given, else 'latest')
        iteration = env.get("RESUME_ITERATION", "")
        opts += ["--mode", "pretrain", "--load", env["RESUME"]] + (["--iteration", iteration] if iteration else [])
    if env.get("EVALUATE") == "1":  # the trained model answers every validation sample (sat_patches evaluate)
        opts += ["--evaluate", evaluation_dir(paths.get("save", env["SAVE_DIR"]))]
    if env.get("LAYER_RANGE"):
        opts += ["--layer_range", *env["LAYER_RANGE"].split()]
    if env.get("CHECKPOINT_ACTIVATIONS", "1") == "1":  # all but the last CHECKPOINT_SKIP_LAYERS, else the plan's
        skip = env.get("CHECKPOINT_SKIP_LAYERS")  # choice, else every layer
        opts += realise.checkpoint_options(Setup(checkpoint_skip_layers=int(skip)) if skip else choice or Setup())
    return opts + shlex.split(env.get("EXTRA_ARGS", ""))


def gpu_commands(env: Dict[str, str], kind: str, checkout: bool) -> List[List[str]]:
    if checkout:
        program = [os.path.join(env["SCRIPT_DIR"], KINDS[kind].upstream_demo)]
    else:
        program = ["-m", "sat_patches", "finetune", "train", "--kind", kind]
    hosts = ["--hostfile", env["HOST_FILE"]] if env.get("HOST_FILE") else ["--num_gpus", env["NUM_GPUS_PER_WORKER"]]
    return [["deepspeed", "--master_port", env["MASTER_PORT"], *hosts, "--module", "sat_patches.launch", *program,
             *train_options(env)]]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def cpu_commands(env: Dict[str, str], kind: str) -> List[List[str]]:
    work = env["WORK_DIR"]
    py = sys.executable
    # the generated demo data (GENERATED_DATA["cpu"]) unless the user gave theirs
    paths = dict(model=os.path.join(work, "model"), tokenizer=os.path.join(work, "tokenizer"),
                 train=env.get("TRAIN_DATA") or os.path.join(work, "data", "train.jsonl"),
                 valid=env.get("VALID_DATA") or os.path.join(work, "data", "valid.jsonl"),
                 save=os.path.join(work, "checkpoints"), ds_config=config_path("cpu_demo.json"))
    options = train_options(env, **paths) + ["--probe", os.path.join(work, "probe.pt")]
    if env.get("EVALUATE") == "1":  # the untrained model first: the baseline the trained one is measured against
        options += ["--evaluate-before", evaluation_dir(paths["save"], before=True)]
        if not env.get("VALID_DATA"):  # the demo's answers are one word: 4 tokens show a wrong one without
            options += ["--evaluate-max-new-tokens", "4"]  # decoding 16 tokens of noise per sample
    return [
        [py, "-m", "sat_patches", "finetune", "prepare", "--kind", kind, "--workdir", work, "--task", GENERATED_DATA["cpu"],
         "--n-train", env["DEMO_TRAIN_SAMPLES"], "--n-valid", env["DEMO_VALID_SAMPLES"]],
        [*TORCHRUN, "--nproc-per-node", env["CPU_RANKS"], "--master-port", env["MASTER_PORT"],
         "-m", "sat_patches.launch", "-m", "sat_patches", "finetune", "train", "--kind", kind, *options],
        [py, "-m", "sat_patches", "merge", steps.latest_run_under(paths["save"]), os.path.join(work, "merged")],
        [py, "-m", "sat_patches", "finetune", "verify", "--kind", kind, "--probe", os.path.join(work, "probe.pt"),
         "--merged", os.path.join(work, "merged"), "--local_tokenizer", paths["tokenizer"],
         "--max_length", env["MAX_LENGTH"], "--version", env["VERSION"]],
        # last, the merged model in the Hugging Face layout (what transformers, PEFT and serving engines read)
        [py, "-m", "sat_patches", "export", "hf", os.path.join(work, "merged"), os.path.join(work, "hf")],
    ]


def prepared_for_resume(env: Dict[str, str]) -> bool:
    """A resumed checkout CPU run whose ``WORK_DIR`` holds the model, tokenizer and data it was prepared with."""
    work = env["WORK_DIR"]
    return bool(env.get("RESUME")) and os.path.isfile(os.path.join(work, "model", "latest")) and all(
        os.path.isdir(os.path.join(work, *d)) for d in (("tokenizer",), ("data", "train"), ("data", "valid")))


def checkout_cpu_commands(env: Dict[str, str], kind: str) -> List[List[str]]:
    """Prepare (unless resumed), train with the checkout's demo on CPU ranks, then check the shards and merge."""
    work, py = env["WORK_DIR"], sys.executable
    checkout = os.path.dirname(os.path.abspath(env["SCRIPT_DIR"]))
    save = os.path.join(work, "checkpoints")
    paths = dict(model=os.path.join(work, "model"), tokenizer=os.path.join(work, "tokenizer"),
                 train=env.get("TRAIN_DATA") or os.path.join(work, "data", "train"),
                 valid=env.get("VALID_DATA") or os.path.join(work, "data", "valid"), save=save,
                 ds_config=run_config(env, "cpu_demo.json", save))
    where = ["--checkout", checkout, "--kind", kind, "--workdir", work]
    prepare = [] if prepared_for_resume(env) else [[py, "-m", "sat_patches.runner.checkout_cpu", "prepare", *where]]
    return prepare + [
        [*TORCHRUN, "--nproc-per-node", env["CPU_RANKS"], "--master-port", env["MASTER_PORT"],
         "-m", "sat_patches.launch", os.path.join(env["SCRIPT_DIR"], KINDS[kind].upstream_demo),
         *train_options(env, **paths)],
        [py, "-m", "sat_patches.runner.checkout_cpu", "verify", *where, "--mp", env["MP_SIZE"],
         "--version", env["VERSION"], "--max_length", env["MAX_LENGTH"]],
    ]


# settings a CPU run cannot honour, and why (said when the user set them)
NOT_ON_CPU = {
    "MODEL_TYPE": "a tiny model of the same architecture is built and trained (the released weights need GPUs)",
    "FROM_PRETRAINED": "a tiny model of the same architecture is built and trained (the released weights need GPUs)",
    "TOKENIZER": "a small local tokenizer is generated (no model hub is reached)",
    "DS_CONFIG": "configs/cpu_demo.json is used (GPU optimizers and offloading do not run on CPU ranks)",
    "NUM_GPUS_PER_WORKER": "CPU_RANKS sets how many ranks run",
    "HOST_FILE": "CPU ranks run on this node only",
    "CHECKPOINT_ACTIVATIONS": "off for the tiny model (nothing to save)",
    "MICRO_BATCH": "the CPU config's micro-batch is used",
    "CHECKPOINT_SKIP_LAYERS": "off for the tiny model (nothing to save)",
}


# the data a CPU run generates where TRAIN_DATA/VALID_DATA are unset: the CPU demo draws coloured shapes (learnt
# in a minute, sat_patches.cogvlm.shapes_data); a checkout's own demo reads folders of <label>.jpg CAPTCHA images
GENERATED_DATA = {"cpu": "shapes", "checkout-cpu": "captcha"}
TASK_WORDS = {"shapes": "generated coloured shapes", "captcha": "generated CAPTCHA images"}


def cpu_notes(env: Dict[str, str], environ: Dict[str, str], run_mode: str = "cpu") -> List[str]:
    """What a CPU run uses of the user's settings, and each setting it cannot honour, with why."""
    generated = TASK_WORDS[GENERATED_DATA[run_mode]]
    notes = [f"{name}: {env[name]}" if env.get(name) else f"{name} not set: {generated} are used"
             for name in ("TRAIN_DATA", "VALID_DATA")]
    notes.append(f"TRAIN_ITERS={env['TRAIN_ITERS']}")
    if run_mode == "checkout-cpu" and prepared_for_resume(env):
        notes.append(f"RESUME: the model, tokenizer and data prepared in {env['WORK_DIR']} are used again")
    if environ.get("MAX_LENGTH", "").isdigit() and int(environ["MAX_LENGTH"]) > int(env["MAX_LENGTH"]):
        notes.append(f"MAX_LENGTH={environ['MAX_LENGTH']} is cut to {env['MAX_LENGTH']}: the tiny model has "
                     f"{env['MAX_LENGTH']} positions (a record longer than that is named, and refused or skipped by "
                     f"SAT_PATCHES_BAD_RECORDS)")
    return notes + [f"{name}={environ[name]} is not used on CPU ranks: {why}"
                    for name, why in NOT_ON_CPU.items() if environ.get(name)]


def cpu_data_errors(env: Dict[str, str], kind: str, run_mode: str) -> List[str]:
    """A ``.jsonl`` TRAIN_DATA/VALID_DATA given to a checkout's demo that reads only folders of images."""
    if run_mode != "checkout-cpu":
        return []
    demo = os.path.join(env["SCRIPT_DIR"], KINDS[kind].upstream_demo)
    with open(demo, encoding="utf-8") as f:
        reads_jsonl = re.search(r"from sat_patches\.cogvlm[\w.]* import [^\n]*\bcreate_dataset_function\b", f.read())
    return [f"{name}={env[name]}: the checkout's {KINDS[kind].upstream_demo} reads folders of <label>.jpg images (its "
            f"ItemDataset), not JSON Lines: pass a folder, or make the demo use sat_patches.cogvlm's "
            f"create_dataset_function" for name in ("TRAIN_DATA", "VALID_DATA")
            if env.get(name, "").endswith(".jsonl") and not reads_jsonl]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__ + "\nSettings and upstream defaults:\n" + "\n".join(
            f"  {k}={v}" for k, v in {**DEFAULTS, **KIND_DEFAULTS["cogvlm"]}.items()) +
            "\nIn a CogVLM checkout with CPU_RANKS set (a CPU smoke test of its demo), the defaults are:\n" +
            "\n".join(f"  {k}={v}" for k, v in {**CHECKOUT_CPU_DEFAULTS,
                                                 "WORK_DIR": "./sat_patches_demo/checkout-<kind>"}.items()))
        return 0
    env = settings(dict(os.environ))
    kind, run_mode = env["MODEL_KIND"], mode(env)
    on_cpu = run_mode in ("cpu", "checkout-cpu")
    env.setdefault("MASTER_PORT", "16666" if not on_cpu else str(free_port()))
    errors = check(env)
    if on_cpu:  # the user's TRAIN_DATA / VALID_DATA, when given (else GENERATED_DATA)
        errors += data_errors(env) + cpu_data_errors(env, kind, run_mode)
    elif env.get("DRY_RUN") != "1":  # a dry run only prints
        errors += data_errors(env)
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2
    cwd = None
    if run_mode == "cpu":
        commands = cpu_commands(env, kind)
    elif run_mode == "checkout-cpu":
        # the demo saves its merged model under ./checkpoints/: run it in the work directory
        cwd = env["WORK_DIR"]
        if env.get("DRY_RUN") != "1":
            os.makedirs(cwd, exist_ok=True)
        commands = checkout_cpu_commands(env, kind)
    else:
        commands = gpu_commands(env, kind, run_mode == "checkout")
    if on_cpu:  # torchrun sets LOCAL_WORLD_SIZE; CPU ranks even where GPUs are visible
        run_env = dict({k: v for k, v in env.items() if k != "LOCAL_WORLD_SIZE"}, CUDA_VISIBLE_DEVICES="")
    else:  # upstream's OPTIONS_NCCL sets LOCAL_WORLD_SIZE for the DeepSpeed launcher
        run_env = dict(env, LOCAL_WORLD_SIZE=env["NUM_GPUS_PER_WORKER"])
    print(f"sat_patches finetune: {kind}, mode {run_mode}, MP_SIZE={env['MP_SIZE']}, TRAINABLE={env['TRAINABLE']}",
          flush=True)
    if on_cpu:
        for line in cpu_notes(env, dict(os.environ), run_mode):
            print(f"note: {line}", flush=True)
    if cwd:
        print(f"+ cd {shlex.quote(cwd)}", flush=True)
    code = steps.run(commands, run_env, cwd, dry_run=env.get("DRY_RUN") == "1")
    if code != 0:
        return code
    if env.get("EVALUATE") == "1" and env.get("DRY_RUN") != "1":  # the run's result, last
        print_evaluations(os.path.join(env["WORK_DIR"], "checkpoints") if run_mode == "cpu" else env["SAVE_DIR"])
    if run_mode == "cpu" and env.get("DRY_RUN") != "1" and os.path.isdir(os.path.join(env["WORK_DIR"], "hf")):
        print(f"Hugging Face export: {os.path.join(env['WORK_DIR'], 'hf')}", flush=True)
    return 0


def print_evaluations(save_dir: str) -> None:
    """The exact match before training (where the CPU demo measured it) and after, one line each."""
    before, out = evaluation_dir(save_dir, before=True), evaluation_dir(save_dir)
    if os.path.isfile(os.path.join(before, "summary.json")):
        summary = read_summary(before)
        print(summary_line(summary, summary["data"], "evaluation before training"), flush=True)
    if os.path.isfile(os.path.join(out, "summary.json")):
        summary = read_summary(out)
        print(summary_line(summary, summary["data"]), flush=True)
    else:  # rank 0 wrote it on another node's disk
        print(f"evaluation: written by rank 0 into {out} on its node", flush=True)


if __name__ == "__main__":
    sys.exit(main())
