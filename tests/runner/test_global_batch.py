"""The global batch is the run's, never the memory's: upstream's by default (DS_CONFIG's micro-batch x accumulation
x data-parallel ranks), GLOBAL_BATCH where set; the plan and MICRO_BATCH only split it into micro-batch x gradient
accumulation, and the two splits train the same model."""
import json
import os
import re

import pytest

from multirank import run_ranks
from test_finetune_scripts import SCRIPTS, run

# stand-ins for nvidia-smi: (GPUs, MiB each)
BOXES = {"8x80": (8, 81920), "2x24": (2, 24576), "1x24": (1, 24576)}


def gpu_box(tmp_path, box):
    """The environment of a node whose nvidia-smi lists ``box``'s cards."""
    count, mib = BOXES[box]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in *memory.total*) ' + "".join(f"echo {mib}; " for _ in range(count)) + ";; "
                   '*) ' + "".join(f'echo "GPU {i}: stand-in"; ' for i in range(count)) + ";; esac\n")
    smi.chmod(0o755)
    return {"DRY_RUN": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NUM_GPUS_PER_WORKER": str(count),
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(count))}


def the_run_config(stdout):
    [cmd] = [l for l in stdout.splitlines() if l.startswith("+ deepspeed")]
    with open(re.search(r"--deepspeed_config (\S+)", cmd).group(1)) as f:
        return json.load(f)


@pytest.mark.parametrize("box, settings, dp, upstreams", [
    ("8x80", {}, 8, 32), ("2x24", {"MP_SIZE": "2"}, 1, 4), ("1x24", {"QLORA": "1"}, 1, 4)])
def test_the_run_trains_upstreams_global_batch_whatever_the_plan_picks(tmp_path, box, settings, dp, upstreams):
    """Upstream's zero2.json: micro-batch 4, no accumulation, on every data-parallel rank."""
    out = run(SCRIPTS["cogvlm"], dict(gpu_box(tmp_path, box), **settings), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    config = the_run_config(out.stdout)
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    assert micro * accumulation * dp == config["train_batch_size"] == upstreams
    lines = out.stdout.splitlines()
    assert lines[1] == (f"global batch {upstreams} = micro-batch {micro} x accumulation {accumulation} x {dp} "
                        f"data-parallel rank{'s' if dp > 1 else ''} (upstream's)")
    assert lines[2].startswith(f"micro-batch {micro} x accumulation {accumulation}: the fastest that fits")


def test_global_batch_is_honoured_and_one_the_ranks_cannot_share_is_refused(tmp_path):
    box = gpu_box(tmp_path, "8x80")
    out = run(SCRIPTS["cogvlm"], dict(box, GLOBAL_BATCH="16"), cwd=tmp_path)
    config = the_run_config(out.stdout)
    assert config["train_batch_size"] == 16
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] == 2
    out = run(SCRIPTS["cogvlm"], dict(box, GLOBAL_BATCH="12"), cwd=tmp_path)
    assert out.returncode == 2 and "+ " not in out.stdout
    assert ("error: GLOBAL_BATCH=12 is not a multiple of the 8 data-parallel ranks (8 ranks / MP_SIZE=1): set "
            "GLOBAL_BATCH to a multiple of 8 (8, 16, 24, ...)") in out.stderr


def test_where_nothing_fits_the_message_names_what_would(tmp_path):
    """One 24 GB card at MP_SIZE=1 with a bf16 base: only QLoRA fits."""
    out = run(SCRIPTS["cogvlm"], gpu_box(tmp_path, "1x24"), cwd=tmp_path)
    assert out.returncode == 2 and "+ " not in out.stdout
    assert "error: nothing fits 1 x 24 GB GPUs at MP_SIZE=1, not even micro-batch 1" in out.stderr
    assert "set QLORA=1, or more GPUs (a larger MP_SIZE) or cards with more memory." in out.stderr


def one_step_each(workdir, micro_batches, global_batch):
    """One optimizer step of the standalone trainer on one CPU rank per micro-batch size, the global batch the
    same: ``{micro-batch: (the step's loss, the trainable parameters after it)}``."""
    import sat.training.deepspeed_training as dt
    from sat_patches.cogvlm import prepare_tiny_run, standalone
    from sat_patches.runner import finetune_run
    tiny = prepare_tiny_run(workdir, "cogvlm", n_train=global_batch, n_valid=1, task="shapes")
    seen, results = {}, {}
    original_step, original_main = dt.train_step, dt.training_main

    def train_step(*a, **kw):
        out = original_step(*a, **kw)
        seen["loss"] = float(out[0])
        return out

    def training_main(*a, **kw):
        seen["model"] = original_main(*a, **kw)
        return seen["model"]

    dt.train_step, dt.training_main = train_step, training_main
    try:
        for micro in micro_batches:
            env = finetune_run.settings({"MODEL_KIND": "cogvlm", "CPU_RANKS": "1", "MP_SIZE": "1", "TRAIN_ITERS": "1",
                                         "GLOBAL_BATCH": str(global_batch), "MICRO_BATCH": str(micro),
                                         "EVALUATE": "0", "CUDA_VISIBLE_DEVICES": "",
                                         # SAT's default dropout draws other masks for other splits
                                         "EXTRA_ARGS": "--hidden-dropout 0 --attention-dropout 0"})
            save = os.path.join(workdir, f"micro{micro}")
            plan = finetune_run.run_plan(env)
            options = finetune_run.train_options(
                env, plan, model=tiny.model_dir, tokenizer=tiny.tokenizer_dir, train=tiny.train_jsonl,
                valid=tiny.valid_jsonl, save=save,
                ds_config=finetune_run.run_config(env, "cpu_demo.json", save, plan.batch))
            assert standalone.train(["--kind", "cogvlm", *options]) == 0
            module = getattr(seen["model"], "module", seen["model"])
            results[micro] = (plan.batch, seen["loss"], {n: p.detach().clone() for n, p in module.named_parameters()
                                                         if p.requires_grad})
    finally:
        dt.train_step, dt.training_main = original_step, original_main
    return results


@pytest.mark.slow
@pytest.mark.multirank
def test_micro_batch_1_with_accumulation_2_trains_what_micro_batch_2_does(tmp_path):
    """fp32, no dropout, the demo's answers one colour word each (equal answer tokens: SAT's mean over a
    micro-batch's tokens then equals the mean of the micro-batches' means)."""
    [rank] = run_ranks(one_step_each, 1, args=(str(tmp_path), [1, 2], 2), timeout=300,
                       env={"SAT_PATCHES_HEARTBEAT_TIMEOUT": "0"})
    assert rank.result is not None, (rank.exception or "") + rank.output[-4000:]
    (b1, loss1, params1), (b2, loss2, params2) = rank.result[1], rank.result[2]
    assert (b1.micro, b1.accumulation, b2.micro, b2.accumulation) == (1, 2, 2, 1)
    assert abs(loss1 - loss2) <= 1e-5 * abs(loss2), (loss1, loss2)
    assert params1.keys() == params2.keys() and params1
    for name, p in params2.items():
        assert (params1[name] - p).norm() <= 1e-4 * p.norm(), name
    assert any(p.norm() > 0 for n, p in params2.items() if "matrix_B" in n)  # the step moved the adapters


def test_a_resumed_run_keeps_the_global_batch_it_trained_with(tmp_path):
    """Saved by 2 nodes (4 ranks at MP_SIZE=2: 2 data-parallel ranks of micro-batch 4), resumed on one node."""
    from sat_patches.runner import finetune_run
    (tmp_path / "arguments.txt").write_text("batch_size = 4\ngradient_accumulation_steps = 1\nworld_size = 4\n"
                                            "eva_args = {'model_parallel_size': 1}\nmodel_parallel_size = 2\n")
    env = finetune_run.settings({"MODEL_KIND": "cogvlm", "CPU_RANKS": "2", "RESUME": str(tmp_path)})
    chosen = finetune_run.run_plan(env).batch
    assert (chosen.size, chosen.micro, chosen.accumulation, chosen.dp) == (8, 4, 2, 1)
    assert chosen.line() == "global batch 8 = micro-batch 4 x accumulation 2 x 1 data-parallel rank (the resumed run's)"
