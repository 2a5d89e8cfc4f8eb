"""finetune_examples/*.sh: pre-launch checks, the commands they build, and the CPU demo end to end."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from report_png import assert_report_has_one_line_per_rank
from test_cpu_user_data import UNIQUE, user_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = {"cogvlm": os.path.join(ROOT, "finetune_examples", "finetune_cogvlm.sh"),
           "cogagent": os.path.join(ROOT, "finetune_examples", "finetune_cogagent.sh")}


def run(script, env=None, cwd=None, timeout=300):
    e = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
    e["PYTHONPATH"] = ROOT  # the scripts' python -m sat_patches... runs this checkout's code
    e.update(env or {})
    return subprocess.run(["bash", script], env=e, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("env, message", [
    ({"MP_SIZE": "3"}, "MP_SIZE=3 does not divide the world size 2 (CPU_RANKS=2 x NNODES=1): set MP_SIZE to one of [1, 2]"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "MP_SIZE": "3"},
     "MP_SIZE=3 does not divide the 32 attention heads of cogvlm-base-490"),
    ({"CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "8"},
     "NUM_GPUS_PER_WORKER=8 but this node has 1 visible GPU(s): set NUM_GPUS_PER_WORKER=1"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "LOCAL_WORLD_SIZE": "8"},
     "LOCAL_WORLD_SIZE=8 but each node runs 2 ranks"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "HOST_FILE": "/nonexistent/hostfile"},
     "HOST_FILE=/nonexistent/hostfile does not exist"),
    ({"MP_SIZE": "two"}, "MP_SIZE='two' is not a whole number"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "TRAINABLE": "all"},
     "TRAINABLE='all': set TRAINABLE=lora (the adapters only) or TRAINABLE=demo"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "MICRO_BATCH": "0"},
     "MICRO_BATCH=0 must be at least 1"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "DS_CONFIG": "zero9.json"},
     "DS_CONFIG=zero9.json is neither a file nor one of the configs installed with sat_patches: set DS_CONFIG to one "
     "of low_memory.json, zero2.json, zero2_offload.json"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "MP_SIZE": "2", "QLORA": "1"},
     "QLORA=1 with MP_SIZE=2: an NF4 base layer has no model-parallel forward; set MP_SIZE=1"),
    ({"CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "1", "QLORA": "yes"}, "QLORA='yes': set QLORA=1"),
    ({"CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "1", "EVALUATE": "yes"}, "EVALUATE='yes': set EVALUATE=1"),
    ({"CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "1", "SAVE_ADAPTER_ONLY": "yes"},
     "SAVE_ADAPTER_ONLY='yes': set 1"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "SAT_PATCHES_SHARED_GPU": "1"},
     "SAT_PATCHES_SHARED_GPU=1 lets several ranks share a GPU, but NUM_GPUS_PER_WORKER=2 ranks on 2 visible GPU(s) "
     "have a card each: unset SAT_PATCHES_SHARED_GPU"),
    ({"CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "2", "SAT_PATCHES_SHARED_GPU": "yes"},
     "SAT_PATCHES_SHARED_GPU='yes': set it to 1"),
], ids=["mp-world", "mp-heads", "gpus-visible", "local-world-size", "hostfile", "not-a-number", "trainable",
         "micro-batch",
         "ds-config", "qlora-mp2", "qlora-word", "evaluate-word", "adapter-word", "shared-gpu-card-each",
         "shared-gpu-word"])
def test_script_refuses_bad_settings_with_the_fix(tmp_path, monkeypatch, capsys, env, message):
    """The runner the script execs (``python -m sat_patches.runner.finetune_run``, with the script's
    ``MODEL_KIND`` and ``SCRIPT_DIR``), called here: the script itself runs in the tests below and in
    :func:`test_the_script_itself_refuses_with_status_2_before_launching`."""
    from sat_patches.runner import finetune_run
    for name in ("LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(env, DRY_RUN="1", MODEL_KIND="cogvlm",
                            SCRIPT_DIR=os.path.dirname(SCRIPTS["cogvlm"])).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert finetune_run.main([]) == 2
    out, err = capsys.readouterr()
    assert message in err, err
    assert "+ " not in out  # nothing launched


def test_the_script_itself_refuses_with_status_2_before_launching(tmp_path):
    out = run(SCRIPTS["cogvlm"], {"MP_SIZE": "3", "DRY_RUN": "1"}, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "MP_SIZE=3 does not divide the world size 2" in out.stderr and "+ " not in out.stdout


def test_resume_settings_continue_a_saved_run_from_the_chosen_iteration(tmp_path):
    run_dir = tmp_path / "checkpoints" / "finetune-run"
    for it in ("2", "4"):
        (run_dir / it).mkdir(parents=True)
    (run_dir / "latest").write_text("4")
    gpus = {"DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "1"}
    out = run(SCRIPTS["cogvlm"], dict(gpus, RESUME=str(run_dir), RESUME_ITERATION="2"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    [cmd] = [l for l in out.stdout.splitlines() if l.startswith("+ deepspeed")]
    assert cmd.endswith(f"--mode pretrain --load {run_dir} --iteration 2") or \
        f"--mode pretrain --load {run_dir} --iteration 2 " in cmd, cmd
    for env, message in (({"RESUME_ITERATION": "2"}, "RESUME_ITERATION needs RESUME="),
                         ({"RESUME": str(tmp_path)}, "is not a directory of saved iterations"),
                         ({"RESUME": str(run_dir), "RESUME_ITERATION": "3"}, "holds iterations 2, 4: set")):
        out = run(SCRIPTS["cogvlm"], dict(gpus, **env), cwd=tmp_path)
        assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


def test_shared_gpu_mode_launches_two_ranks_on_one_visible_gpu(tmp_path):
    env = {"DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "2", "MP_SIZE": "2"}
    refused = run(SCRIPTS["cogvlm"], env, cwd=tmp_path)
    assert refused.returncode == 2 and "to debug several ranks on one GPU, SAT_PATCHES_SHARED_GPU=1" in refused.stderr
    out = run(SCRIPTS["cogvlm"], dict(env, SAT_PATCHES_SHARED_GPU="1"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    [cmd] = [l for l in out.stdout.splitlines() if l.startswith("+ deepspeed")]
    assert "--num_gpus 2 " in cmd and "--model-parallel-size 2" in cmd


def test_gpu_mode_runs_standalone_demo_under_deepspeed_with_settings(tmp_path):
    out = run(SCRIPTS["cogagent"], {"DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2",
                                   "MP_SIZE": "2", "DS_CONFIG": "zero2_offload.json"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    [cmd] = [l for l in out.stdout.splitlines() if l.startswith("+ deepspeed")]
    assert "--num_gpus 2 --module sat_patches.launch -m sat_patches finetune train --kind cogagent" in cmd
    for expected in ("--model-parallel-size 2", "--from_pretrained cogagent-chat", "--max_length 400",
                     "--lora_rank 50", "--train-iters 2000", "--version chat", "/zero2_offload.global_batch4.micro_batch4.accumulation1.json"):
        assert expected in cmd


def test_qlora_setting_passes_upstreams_use_qlora_at_mp1(tmp_path):
    out = run(SCRIPTS["cogvlm"], {"DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "1",
                                  "QLORA": "1"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    [cmd] = [l for l in out.stdout.splitlines() if l.startswith("+ deepspeed")]
    assert "--use_qlora" in cmd.split() and "--use_lora" not in cmd.split() and "--model-parallel-size 1" in cmd


def _deepspeed_config_of(stdout):
    [cmd] = [l for l in stdout.splitlines() if l.startswith("+ deepspeed")]
    path = re.search(r"--deepspeed_config (\S+)", cmd).group(1)
    with open(path) as f:
        return path, json.load(f)


@pytest.mark.parametrize("env", [{}, {"NUM_GPUS_PER_WORKER": "0"}], ids=["default", "zero-gpus"])
def test_in_a_checkout_without_gpus_one_message_names_both_ways_out(tmp_path, env):
    demo_dir = tmp_path / "CogVLM" / "finetune_demo"
    demo_dir.mkdir(parents=True)
    (demo_dir / "finetune_cogvlm_demo.py").write_text("# upstream demo stand-in\n")
    shutil.copy(SCRIPTS["cogvlm"], demo_dir)
    out = run(str(demo_dir / "finetune_cogvlm.sh"), dict(env, DRY_RUN="1", CUDA_VISIBLE_DEVICES=""), cwd=tmp_path)
    errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-2000:]
    assert "make the GPUs visible" in errors[0] and "CPU_RANKS=2 bash finetune_cogvlm.sh" in errors[0]
    assert "NUM_GPUS_PER_WORKER=8" not in errors[0] and "must be at least" not in errors[0]


def _batch_of(config):
    return (config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"])


def test_micro_batch_keeps_the_global_batch_and_is_written_into_the_config_the_run_uses(tmp_path):
    """2 GPUs at MP_SIZE=2: one data-parallel rank, upstream's global batch 4 (zero2.json's micro-batch 4)."""
    env = {"DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "MP_SIZE": "2"}
    out = run(SCRIPTS["cogvlm"], dict(env, MICRO_BATCH="2"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    path, config = _deepspeed_config_of(out.stdout)
    assert _batch_of(config) == (4, 2, 2) and path.startswith(str(tmp_path / "checkpoints"))
    assert config["zero_optimization"]["stage"] == 2  # the rest is DS_CONFIG's (zero2.json)
    assert "global batch 4 = micro-batch 2 x accumulation 2 x 1 data-parallel rank (upstream's)" in out.stdout
    # no MICRO_BATCH and no GPU memory to plan with: DS_CONFIG's micro-batch
    out = run(SCRIPTS["cogvlm"], env, cwd=tmp_path)
    path, config = _deepspeed_config_of(out.stdout)
    assert _batch_of(config) == (4, 4, 1)
    assert "micro-batch 4 x accumulation 1: zero2.json's (no GPU memory figure from nvidia-smi" in out.stdout
    out = run(SCRIPTS["cogvlm"], dict(env, MICRO_BATCH="3"), cwd=tmp_path)
    assert out.returncode == 2 and "MICRO_BATCH=3 does not divide the 4 samples each data-parallel rank takes per " \
        "step (global batch 4 (upstream's) / 1 ranks): set MICRO_BATCH to one of [1, 2, 4]" in out.stderr


def test_micro_batch_and_skip_default_to_the_plans_choice_for_the_detected_gpus(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # two 24 GB cards
    smi.write_text('#!/bin/sh\ncase "$*" in *memory.total*) echo 24576; echo 24576;; '
                   '*) echo "GPU 0: RTX"; echo "GPU 1: RTX";; esac\n')
    smi.chmod(0o755)
    env = {"DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS_PER_WORKER": "2", "MP_SIZE": "2",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = run(SCRIPTS["cogvlm"], env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    _, config = _deepspeed_config_of(out.stdout)
    plan = subprocess.run([sys.executable, "-m", "sat_patches", "plan", "--model", "cogvlm-base-490", "--gpus", "2",
                           "--gpu-mem", "24", "--json"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    fits = [o for o in json.loads(plan.stdout)["options"] if o["viable"] and o["setup"]["mp"] == 2
            and o["setup"]["zero"] == 2 and not o["setup"]["offload"] and not o["setup"]["qlora"]]
    fastest = max(fits, key=lambda o: o["tokens_per_s"])["setup"]  # the fastest that fits, its skip beside it
    assert config["train_micro_batch_size_per_gpu"] == fastest["micro_batch"] != 4
    [cmd] = [l for l in out.stdout.splitlines() if l.startswith("+ deepspeed")]
    assert f"--checkpoint-skip-layers {fastest['checkpoint_skip_layers']}" in cmd and fastest["checkpoint_skip_layers"]


def test_in_a_cogvlm_checkout_it_runs_upstreams_demo_through_the_launcher(tmp_path):
    demo_dir = tmp_path / "CogVLM" / "finetune_demo"
    demo_dir.mkdir(parents=True)
    (demo_dir / "finetune_cogvlm_demo.py").write_text("# upstream demo stand-in\n")
    shutil.copy(SCRIPTS["cogvlm"], demo_dir)
    out = run(str(demo_dir / "finetune_cogvlm.sh"), {"DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
                                                    "NUM_GPUS_PER_WORKER": "4", "MP_SIZE": "4"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"--module sat_patches.launch {demo_dir / 'finetune_cogvlm_demo.py'} " in out.stdout
    assert "mode checkout" in out.stdout and "TRAINABLE=demo" in out.stdout  # the demo's own choice by default


def test_in_a_checkout_an_empty_or_broken_data_set_is_refused_before_launching(tmp_path):
    """Upstream's demo would build the 17B model and then divide by zero in SAT (THUDM/CogVLM#509)."""
    demo_dir = tmp_path / "CogVLM" / "finetune_demo"
    demo_dir.mkdir(parents=True)
    (demo_dir / "finetune_cogvlm_demo.py").write_text("raise SystemExit('launched')\n")
    shutil.copy(SCRIPTS["cogvlm"], demo_dir)
    (tmp_path / "empty").mkdir()
    (tmp_path / "valid.jsonl").write_text('{"image": "gone.jpg", "prompt": "CAPTCHA:", "answer": "ab12"}\n')
    out = run(str(demo_dir / "finetune_cogvlm.sh"), {"CUDA_VISIBLE_DEVICES": "0", "NUM_GPUS_PER_WORKER": "1",
                                                    "TRAIN_DATA": str(tmp_path / "empty"),
                                                    "VALID_DATA": str(tmp_path / "valid.jsonl")}, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"TRAIN_DATA={tmp_path / 'empty'}: data folder {tmp_path / 'empty'} holds no readable .jpg" in out.stderr
    assert f"{tmp_path / 'valid.jsonl'}:1: image {tmp_path / 'gone.jpg'} does not exist" in out.stderr
    assert "+ " not in out.stdout and "launched" not in out.stderr


def assert_the_demo_ran(out, work, iters, log_interval=5):
    """Trained ``iters`` steps at MP=2 (a loss every ``log_interval``), saved what resumes the run, merged the
    LoRA and both shards into one MP=1 checkpoint whose logits equal the trained model's and whose answer to the
    first validation sample is the trained model's; exported it. Returns ``(losses, before, after, predictions)``:
    the logged losses, the two evaluation lines' matches, the trained model's predictions and the merged model's
    answer."""
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    steps = re.findall(rf"^iteration (\d+)/{iters} \| loss ([0-9.]+) \| lr \S+ \| [0-9.]+ s/it \| ETA \d+:\d\d:\d\d$",
                       out.stdout, re.M)
    assert [int(i) for i, _ in steps] == list(range(log_interval, iters + 1, log_interval)), out.stdout[-3000:]
    losses = [float(loss) for _, loss in steps]
    assert "elapsed time per iteration" not in log  # SAT's long line is replaced, not repeated
    assert "time (ms)" not in log and " ....... " not in log and len(out.stdout.splitlines()) < 100  # readable
    [run_dir] = [d for d in (work / "checkpoints").iterdir() if (d / "latest").is_file()]
    assert sorted(os.listdir(run_dir / str(iters))) == [
        "adapter.json",  # LoRA only trains: the adapters and their base
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]  # resumable
    assert os.listdir(work / "merged" / "1") == ["mp_rank_00_model_states.pt"]
    diff = float(re.search(r"max \|logit difference\| = ([0-9.e+-]+)", log).group(1))
    assert diff <= 1e-4
    # the last lines: every validation sample answered by the untrained model, then by the trained one
    lines = out.stdout.splitlines()
    assert lines[-1] == f"Hugging Face export: {work / 'hf'}" and (work / "hf" / "config.json").is_file()
    before = re.search(r"^evaluation before training: exact match (\d+)/(\d+) \(", lines[-3])
    evaluation = re.search(r"^evaluation: exact match (\d+)/(\d+) \(", lines[-2])
    assert before and evaluation and before.group(2) == evaluation.group(2), out.stdout[-1000:]
    found = {}
    for name, match in (("evaluation_before_training", before), ("evaluation", evaluation)):
        with open(work / "checkpoints" / name / "predictions.jsonl") as f:
            found[name] = [json.loads(line) for line in f]
        assert sum(p["exact"] for p in found[name]) == int(match.group(1))
        assert len(found[name]) == int(match.group(2))
    predictions = found["evaluation"]
    # the merged MP=1 model answers the first validation sample as the trained MP=2 model did (in up to 8 tokens,
    # the evaluation in up to its --evaluate-max-new-tokens: the shorter answer begins the longer)
    said = re.search(r"^merged model output for '([^']*)': ('.*?')(?: \(it ends the answer at once|$)", log, re.M)
    answer = ast.literal_eval(said.group(2))
    shorter, longer = sorted((predictions[0]["prediction"], answer.strip()), key=len)
    assert said.group(1) == predictions[0]["id"] and longer.startswith(shorter), (said.group(0), predictions[0])
    with open(run_dir / "loss_curve.csv") as f:  # the curve beside the memory ledger, drawn as it grows
        assert [round(float(r.split(",")[1]), 4) for r in f.read().split()[1:]] == losses
    assert (run_dir / "loss_curve.png").stat().st_size > 10_000
    assert f"train_iters = {iters}" in (run_dir / "arguments.txt").read_text()  # SAT's argument dump, kept
    assert len((run_dir / "step_times.csv").read_text().splitlines()) == iters // log_interval + 1  # its timer lines
    return losses, before, evaluation, predictions, answer


@pytest.mark.slow
@pytest.mark.multirank
def test_cpu_demo_learns_at_mp2_merges_and_reloads_with_equal_outputs(tmp_path):
    """The README's main job, as it is: finetune_cogvlm.sh with no settings on a machine without a GPU."""
    out = run(SCRIPTS["cogvlm"], cwd=tmp_path, timeout=600)
    work = tmp_path / "sat_patches_demo" / "cogvlm"
    losses, before, evaluation, predictions, answer = assert_the_demo_ran(out, work, iters=50)
    assert answer == predictions[0]["prediction"] != "", (answer, predictions[0])  # a whole answer, the same
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < losses[0] / 4, losses
    # it trained on the generated JSONL records and learnt: 0% before, at least 80% after
    assert "--train-data " + str(work / "data" / "train.jsonl") in out.stdout
    assert int(before.group(2)) == 16 and int(before.group(1)) == 0 and int(evaluation.group(1)) >= 0.8 * 16, \
        (before.group(0), evaluation.group(0))
    [run_dir] = [d for d in (work / "checkpoints").iterdir() if (d / "latest").is_file()]
    assert_report_has_one_line_per_rank(run_dir, tmp_path / "ledger.png")   # the demo's memory ledger


@pytest.mark.slow
@pytest.mark.multirank
def test_cogagent_cpu_run_on_the_users_records_merges_and_reloads_with_equal_outputs(tmp_path):
    """finetune_cogagent.sh without a GPU, on the user's TRAIN_DATA / VALID_DATA and TRAIN_ITERS: what is
    CogAgent's own (its cross-attention encoder trained at MP=2, its evaluation, merge, reload and export) and
    what the user's settings change, in one shorter run. That the demo's recipe learns is the main job's test
    above; here the loss falls and the trained model answers the user's records (the record only the user's
    file holds among them), in up to 4 tokens each (EXTRA_ARGS, passed on to the trainer: 16 tokens, the
    default, take a third of the run)."""
    data = user_jsonl(tmp_path / "data")
    out = run(SCRIPTS["cogagent"], {"TRAIN_DATA": "data/mine.jsonl", "VALID_DATA": data, "TRAIN_ITERS": "10",
                                    "SAVE_INTERVAL": "10", "LOG_INTERVAL": "1",
                                    "EXTRA_ARGS": "--evaluate-max-new-tokens 4"}, cwd=tmp_path, timeout=600)
    work = tmp_path / "sat_patches_demo" / "cogagent"
    losses, before, _, predictions, _ = assert_the_demo_ran(out, work, iters=10, log_interval=1)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    assert f"note: TRAIN_DATA: {data}" in out.stdout and f"--train-data {data} " in out.stdout
    assert re.search(r"^\+ .* -m sat_patches finetune train .* --evaluate-max-new-tokens 4( |$)", out.stdout, re.M)
    assert int(before.group(2)) == 6 and [p["id"] for p in predictions][0] == UNIQUE, predictions
