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

Every mode trains the global batch the user set (``GLOBAL_BATCH``, default upstream's: :mod:`.batch`), split by
``MICRO_BATCH`` or the plan (:mod:`.sizing`); on several nodes DeepSpeed's hostfile, or the script on each node
under torchrun or Slurm, starts the ranks (:mod:`.cluster`). ``DRY_RUN=1`` prints the commands instead of running
them.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Dict, List, Optional

from ..cogvlm.config import tiny_config
from ..cogvlm.scores import read_summary, summary_line
from ..core.kinds import KINDS
from ..core.ports import free_port
from ..planning import realise
from ..planning.memory import Setup
from . import batch, cluster, steps
from .finetune_check import check, config_path, data_errors, visible_gpus  # noqa: F401  (config_path: for callers)
from .sizing import PlanError, RunPlan, run_config, run_plan

# upstream's finetune_demo/finetune_cog{vlm,agent}_lora.sh values (NUM_GPUS_PER_WORKER=8 there too)
DEFAULTS = {
    "NUM_GPUS_PER_WORKER": "8", "MP_SIZE": "1", "NNODES": "1", "HOST_FILE": "", "VERSION": "base",
    "TOKENIZER": "lmsys/vicuna-7b-v1.5", "TRAIN_DATA": "./archive_split/train", "VALID_DATA": "./archive_split/valid",
    "SAVE_DIR": "./checkpoints", "SAVE_INTERVAL": "200", "EVAL_INTERVAL": "200", "LOG_INTERVAL": "50",
    "SEED": "2023", "DS_CONFIG": "zero2.json", "LAYER_RANGE": "", "CHECKPOINT_ACTIVATIONS": "1",
    "GLOBAL_BATCH": "",  # samples per optimizer step; empty: upstream's (DS_CONFIG's micro-batch x accumulation x
                         # data-parallel ranks), a resumed run's own
    "MICRO_BATCH": "",  # empty: the plan's choice for the detected GPUs, else DS_CONFIG's; accumulation follows
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
                "CHECKPOINT_ACTIVATIONS": "0",
                "MERGE": "1"}  # 0: no merge, reload check and export after training
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
    env.update(cluster.node_settings(environ))  # Slurm's variables, the hostfile's nodes: under the user's own
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


def mode(env: Dict[str, str]) -> str:
    cpu_ranks, demo = env.get("CPU_RANKS") not in (None, "", "0"), KINDS[env["MODEL_KIND"]].upstream_demo
    if env.get("SCRIPT_DIR") and os.path.isfile(os.path.join(env["SCRIPT_DIR"], demo)):
        return "checkout-cpu" if cpu_ranks else "checkout"
    return "gpu" if not cpu_ranks and visible_gpus(env) > 0 else "cpu"


def evaluation_dir(save_dir: str, before: bool = False) -> str:
    """Where ``EVALUATE=1`` writes its results (``before``: the untrained model's)."""
    return os.path.join(save_dir, "evaluation_before_training" if before else "evaluation")


def train_options(env: Dict[str, str], plan: Optional[RunPlan] = None, **paths) -> List[str]:
    """Upstream's ``gpt_options`` and ``MODEL_ARGS``, with the scripts' settings filled in (``plan``: the run's
    global batch and checkpointing, default :func:`run_plan`'s; a ``ds_config`` path given is used as it is)."""
    plan = plan or (None if paths.get("ds_config") else run_plan(env))
    save = paths.get("save", env["SAVE_DIR"])
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
        "--save", save, "--eval-iters", "10", "--eval-batch-size", "1",
        "--split", "1.", "--deepspeed_config",
        paths.get("ds_config") or run_config(env, batch.config_name(env), save, plan.batch),
        "--seed", env["SEED"], "--log-interval", env["LOG_INTERVAL"],
    ]
    if env.get("RESUME"):  # continue that run (from RESUME_ITERATION where given, else 'latest')
        iteration = env.get("RESUME_ITERATION", "")
        opts += ["--mode", "pretrain", "--load", env["RESUME"]] + (["--iteration", iteration] if iteration else [])
    if env.get("EVALUATE") == "1":  # the trained model answers every validation sample (sat_patches evaluate)
        opts += ["--evaluate", evaluation_dir(save)]
    if env.get("LAYER_RANGE"):
        opts += ["--layer_range", *env["LAYER_RANGE"].split()]
    if env.get("CHECKPOINT_ACTIVATIONS", "1") == "1":  # all but the last CHECKPOINT_SKIP_LAYERS, else the plan's
        skip = env.get("CHECKPOINT_SKIP_LAYERS")  # choice, else every layer
        choice = plan and plan.setup
        opts += realise.checkpoint_options(Setup(checkpoint_skip_layers=int(skip)) if skip else choice or Setup())
    return opts + shlex.split(env.get("EXTRA_ARGS", ""))


def gpu_commands(env: Dict[str, str], kind: str, checkout: bool, plan: Optional[RunPlan] = None) -> List[List[str]]:
    """DeepSpeed's launcher (over the hostfile's nodes, or this node), or torchrun on this node of ``NNODES``."""
    if checkout:
        program = [os.path.join(env["SCRIPT_DIR"], KINDS[kind].upstream_demo)]
    else:
        program = ["-m", "sat_patches", "finetune", "train", "--kind", kind]
    program += train_options(env, plan)
    if cluster.multi_node(env) and not env.get("HOST_FILE"):
        return [[*cluster.torchrun(env, env["NUM_GPUS_PER_WORKER"]), "-m", "sat_patches.launch", *program]]
    hosts = ["--hostfile", env["HOST_FILE"], "--num_nodes", env["NNODES"]] if env.get("HOST_FILE") else []
    return [["deepspeed", "--master_port", env["MASTER_PORT"], *hosts, "--num_gpus", env["NUM_GPUS_PER_WORKER"],
             "--module", "sat_patches.launch", *program]]


def cpu_commands(env: Dict[str, str], kind: str, plan: Optional[RunPlan] = None) -> List[List[str]]:
    """Prepare (unless resumed), train, then merge, check and export (``MERGE=0``: not those three); on a node
    other than the first of ``NNODES``, only train."""
    work = env["WORK_DIR"]
    py = sys.executable
    save = os.path.join(work, "checkpoints")
    # the generated demo data (GENERATED_DATA["cpu"]) unless the user gave theirs
    paths = dict(model=os.path.join(work, "model"), tokenizer=os.path.join(work, "tokenizer"),
                 train=env.get("TRAIN_DATA") or os.path.join(work, "data", "train.jsonl"),
                 valid=env.get("VALID_DATA") or os.path.join(work, "data", "valid.jsonl"),
                 save=save, ds_config=run_config(env, "cpu_demo.json", save, (plan or run_plan(env)).batch))
    options = train_options(env, **paths) + ["--probe", os.path.join(work, "probe.pt")]
    if env.get("EVALUATE") == "1":  # the untrained model first: the baseline the trained one is measured against
        options += ["--evaluate-before", evaluation_dir(paths["save"], before=True)]
        if not env.get("VALID_DATA"):  # the demo's answers are one word: 4 tokens show a wrong one without
            options += ["--evaluate-max-new-tokens", "4"]  # decoding 16 tokens of noise per sample
    train = [*cluster.torchrun(env, env["CPU_RANKS"]), "-m", "sat_patches.launch", "-m", "sat_patches", "finetune",
             "train", "--kind", kind, *options]
    if not cluster.first_node(env):
        return [train]
    prepare = [py, "-m", "sat_patches", "finetune", "prepare", "--kind", kind, "--workdir", work, "--task",
               GENERATED_DATA["cpu"], "--n-train", env["DEMO_TRAIN_SAMPLES"], "--n-valid", env["DEMO_VALID_SAMPLES"]]
    after = [
        [py, "-m", "sat_patches", "merge", steps.latest_run_under(paths["save"]), os.path.join(work, "merged")],
        [py, "-m", "sat_patches", "finetune", "verify", "--kind", kind, "--probe", os.path.join(work, "probe.pt"),
         "--merged", os.path.join(work, "merged"), "--local_tokenizer", paths["tokenizer"],
         "--max_length", env["MAX_LENGTH"], "--version", env["VERSION"]],
        # last, the merged model in the Hugging Face layout (what transformers, PEFT and serving engines read)
        [py, "-m", "sat_patches", "export", "hf", os.path.join(work, "merged"), os.path.join(work, "hf")],
    ] if env.get("MERGE", "1") == "1" else []
    return ([] if prepared_for_resume(env, "cpu") else [prepare]) + [train] + after


# what a CPU run's prepare step writes into WORK_DIR beside the model: the tokenizer and the data
PREPARED = {"cpu": ("tokenizer", "data/train.jsonl", "data/valid.jsonl"),
            "checkout-cpu": ("tokenizer", "data/train", "data/valid")}


def prepared_for_resume(env: Dict[str, str], run_mode: str = "checkout-cpu") -> bool:
    """A resumed CPU run whose ``WORK_DIR`` holds the model, tokenizer and data it was prepared with."""
    work = env["WORK_DIR"]
    return bool(env.get("RESUME")) and os.path.isfile(os.path.join(work, "model", "latest")) and all(
        os.path.exists(os.path.join(work, p)) for p in PREPARED[run_mode])


def checkout_cpu_commands(env: Dict[str, str], kind: str, plan: Optional[RunPlan] = None) -> List[List[str]]:
    """Prepare (unless resumed), train with the checkout's demo on CPU ranks, then check the shards and merge (on a
    node other than the first of ``NNODES``: only train)."""
    work, py = env["WORK_DIR"], sys.executable
    checkout = os.path.dirname(os.path.abspath(env["SCRIPT_DIR"]))
    save = os.path.join(work, "checkpoints")
    paths = dict(model=os.path.join(work, "model"), tokenizer=os.path.join(work, "tokenizer"),
                 train=env.get("TRAIN_DATA") or os.path.join(work, "data", "train"),
                 valid=env.get("VALID_DATA") or os.path.join(work, "data", "valid"), save=save,
                 ds_config=run_config(env, "cpu_demo.json", save, (plan or run_plan(env)).batch))
    where = ["--checkout", checkout, "--kind", kind, "--workdir", work]
    train = [*cluster.torchrun(env, env["CPU_RANKS"]), "-m", "sat_patches.launch",
             os.path.join(env["SCRIPT_DIR"], KINDS[kind].upstream_demo), *train_options(env, **paths)]
    if not cluster.first_node(env):
        return [train]
    prepare = [] if prepared_for_resume(env) else [[py, "-m", "sat_patches.runner.checkout_cpu", "prepare", *where]]
    return prepare + [train, [py, "-m", "sat_patches.runner.checkout_cpu", "verify", *where, "--mp", env["MP_SIZE"],
                              "--version", env["VERSION"], "--max_length", env["MAX_LENGTH"]]]


# settings a CPU run cannot honour, and why (said when the user set them)
NOT_ON_CPU = {
    "MODEL_TYPE": "a tiny model of the same architecture is built and trained (the released weights need GPUs)",
    "FROM_PRETRAINED": "a tiny model of the same architecture is built and trained (the released weights need GPUs)",
    "TOKENIZER": "a small local tokenizer is generated (no model hub is reached)",
    "DS_CONFIG": "configs/cpu_demo.json is used (GPU optimizers and offloading do not run on CPU ranks)",
    "NUM_GPUS_PER_WORKER": "CPU_RANKS sets how many ranks run",
    "HOST_FILE": "torchrun starts the CPU ranks of each node (NNODES, NODE_RANK, MASTER_ADDR), not ssh",
    "CHECKPOINT_ACTIVATIONS": "off for the tiny model (nothing to save)",
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
    # every node must use the same port: upstream's (deepspeed --master_port 16666), a free one for CPU ranks alone
    env.setdefault("MASTER_PORT", str(free_port()) if on_cpu and not cluster.multi_node(env) else "16666")
    errors = check(env)
    if on_cpu:  # the user's TRAIN_DATA / VALID_DATA, when given (else GENERATED_DATA)
        errors += data_errors(env) + cpu_data_errors(env, kind, run_mode)
    elif env.get("DRY_RUN") != "1":  # a dry run only prints
        errors += data_errors(env)
    try:
        plan = None if errors else run_plan(env)
    except PlanError as exc:
        errors.append(str(exc))
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2
    cwd = None
    if run_mode == "cpu":
        commands = cpu_commands(env, kind, plan)
    elif run_mode == "checkout-cpu":
        # the demo saves its merged model under ./checkpoints/: run it in the work directory
        cwd = env["WORK_DIR"]
        if env.get("DRY_RUN") != "1":
            os.makedirs(cwd, exist_ok=True)
        commands = checkout_cpu_commands(env, kind, plan)
    else:
        commands = gpu_commands(env, kind, run_mode == "checkout", plan)
    # the launcher takes the rendezvous as arguments and sets it for its ranks: a step of one process (prepare,
    # merge) that read it would host its own store on that port, where another node's launcher could connect
    run_env = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    if on_cpu:  # torchrun sets LOCAL_WORLD_SIZE; CPU ranks even where GPUs are visible
        run_env = dict({k: v for k, v in run_env.items() if k != "LOCAL_WORLD_SIZE"}, CUDA_VISIBLE_DEVICES="")
    else:  # upstream's OPTIONS_NCCL sets LOCAL_WORLD_SIZE for the DeepSpeed launcher
        run_env = dict(run_env, LOCAL_WORLD_SIZE=env["NUM_GPUS_PER_WORKER"])
    if plan.setup is not None and not env.get("CHECKPOINT_SKIP_LAYERS"):  # the plan's levers, under the user's own
        run_env = dict(realise.lever_settings(plan.setup), **run_env)
    print(f"sat_patches finetune: {kind}, mode {run_mode}, MP_SIZE={env['MP_SIZE']}, TRAINABLE={env['TRAINABLE']}",
          flush=True)
    print(plan.batch.line(), flush=True)
    print(plan.why, flush=True)
    if cluster.multi_node(env) and (on_cpu or not env.get("HOST_FILE")):
        print(cluster.node_line(env), flush=True)
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
    if run_mode == "cpu" and env.get("DRY_RUN") != "1" and env["MERGE"] == "1" and cluster.first_node(env):
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
