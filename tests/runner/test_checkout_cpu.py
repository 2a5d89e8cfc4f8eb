"""The drop-in scripts in a CogVLM checkout with no GPU: CPU_RANKS=2 runs the checkout's own demo on CPU
ranks (tiny checkpoint from its classes, train at MP=2, save both shards, its LoRA merge), and without
CPU_RANKS one message names both ways out. The checkout is the synthetic one of tests/support/fake_checkout.py. The end-to-end
runs of the synthetic checkout's demos are the user's path: CogAgent's from a wheel (test_checkout_wheel.py),
CogVLM's through the GPU kit's tiny run (tests/benchmarks/test_gpu_kit_fork.py); a real checkout's runs here."""
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys

import pytest

from fake_checkout import write_fake_checkout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = {"cogvlm": os.path.join(ROOT, "finetune_examples", "finetune_cogvlm.sh"),
           "cogagent": os.path.join(ROOT, "finetune_examples", "finetune_cogagent.sh")}


def checkout_with_script(tmp_path, kind):
    """A synthetic checkout with only the drop-in script added to its finetune_demo/."""
    checkout = write_fake_checkout(str(tmp_path / "CogVLM"))
    shutil.copy(SCRIPTS[kind], os.path.join(checkout, "finetune_demo"))
    return checkout, os.path.join(checkout, "finetune_demo", os.path.basename(SCRIPTS[kind]))


def script_env(env=None):
    e = {k: v for k, v in os.environ.items()
         if k not in ("LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "CPU_RANKS", "NUM_GPUS_PER_WORKER", "MP_SIZE")}
    e["PYTHONPATH"] = ROOT
    e["PATH"] = os.pathsep.join(p for p in e.get("PATH", "").split(os.pathsep)
                                if not os.path.isfile(os.path.join(p, "nvidia-smi")))  # no GPU here
    e.update(env or {})
    return e


def run(script, env=None, cwd=None, timeout=300):
    return subprocess.run(["bash", script], env=script_env(env), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_fake_checkout_has_upstreams_layout(tmp_path):
    checkout = write_fake_checkout(str(tmp_path / "CogVLM"))
    for rel in ("finetune_demo/finetune_cogvlm_demo.py", "finetune_demo/finetune_cogagent_demo.py",
                "utils/models/__init__.py", "utils/models/cogvlm_model.py", "utils/models/cogagent_model.py",
                "utils/utils/__init__.py"):
        path = os.path.join(checkout, rel)
        assert os.path.isfile(path), rel
        py_compile.compile(path, doraise=True)
    demo = open(os.path.join(checkout, "finetune_demo", "finetune_cogvlm_demo.py")).read()
    for upstream in ("FineTuneTrainCogVLMModel.from_pretrained", "training_main(", "forward_step_eval=",
                     'get_mixin("lora").merge_lora()', "merged_lora_cogvlm", "save_checkpoint(1, model, None, None, args)"):
        assert upstream in demo
    with pytest.raises(FileExistsError, match="choose an empty directory"):
        write_fake_checkout(checkout)


def test_tiny_config_has_the_released_keys_and_upstreams_eva_width():
    from sat_patches.cogvlm import UPSTREAM_CONFIGS
    from sat_patches.cogvlm.config import tiny_config
    for kind, released in (("cogvlm", "cogvlm-base-490"), ("cogagent", "cogagent-chat")):
        config = tiny_config(kind, upstream_classes=True)
        assert list(config) == list(UPSTREAM_CONFIGS[released])
        assert list(config["eva_args"]) == list(UPSTREAM_CONFIGS[released]["eva_args"])
        assert config["eva_args"]["hidden_size"] == 1792 and config["eva_args"]["num_layers"] <= 2
        assert config["vocab_size"] >= 1000 and config["num_layers"] == 2


@pytest.mark.slow
def test_tiny_checkpoint_is_built_with_the_checkouts_classes(tmp_path):
    """In a fresh process (the checkout's utils package must not leak into this one)."""
    checkout = write_fake_checkout(str(tmp_path / "CogVLM"))
    probe = f"""
import json, os, sys, torch
from sat_patches.runner.checkout_cpu import build_tiny_checkpoint, tiny_config
info = build_tiny_checkpoint({checkout!r}, "cogvlm", {str(tmp_path / 'model')!r})
assert info["class"] == "utils.models.cogvlm_model.CogVLMModel", info
state = torch.load({str(tmp_path / 'model' / '1' / 'mp_rank_00_model_states.pt')!r})["module"]
experts = [k for k in state if k.startswith(("mixins.mlp.", "mixins.rotary.")) and state[k].dim() == 2]
assert experts and all(0.01 < float(state[k].std()) < 0.03 for k in experts), experts
assert all(torch.isfinite(v).all() for v in state.values())
print("OK", len(state))
# the synthetic checkout refuses an EVA width its image projector cannot take, as upstream's would fail
build_tiny_checkpoint.__globals__["tiny_config"] = lambda k, upstream_classes, f=tiny_config: {{**f(k, True), "eva_args": {{**f(k, True)["eva_args"], "hidden_size": 64}}}}
try:
    build_tiny_checkpoint({checkout!r}, "cogvlm", {str(tmp_path / 'narrow')!r})
except BaseException as exc:  # noqa: B036 (a SystemExit with the message counts as refused)
    print("REFUSED", exc)
else:
    print("ACCEPTED")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout
    with open(tmp_path / "model" / "model_config.json") as f:
        assert json.load(f)["eva_args"]["hidden_size"] == 1792
    assert "REFUSED" in out.stdout and "keep eva_args.hidden_size 1792" in out.stdout + out.stderr, out.stdout[-2000:]


@pytest.mark.parametrize("env", [{}, {"NUM_GPUS_PER_WORKER": "0"}, {"CUDA_VISIBLE_DEVICES": ""},
                                 {"NUM_GPUS_PER_WORKER": "2", "MP_SIZE": "2"}],
                         ids=["defaults", "zero-gpus", "cuda-visible-empty", "two-gpus-asked"])
def test_no_gpu_in_a_checkout_gives_one_message_naming_both_ways_out(tmp_path, env):
    _, script = checkout_with_script(tmp_path, "cogvlm")
    out = run(script, dict(env, DRY_RUN="1"), cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, errors
    [message] = errors
    assert "no GPU is visible" in message and "make the GPUs visible" in message
    assert "CPU_RANKS=2 bash finetune_cogvlm.sh" in message and "finetune_cogvlm_demo.py" in message
    assert not re.search(r"NUM_GPUS_PER_WORKER=\d", message.replace("NUM_GPUS_PER_WORKER=0", ""))  # no number to set
    assert "+ " not in out.stdout


def test_zero_gpus_asked_with_gpus_visible_names_both_ways_out(tmp_path):
    _, script = checkout_with_script(tmp_path, "cogvlm")
    out = run(script, {"DRY_RUN": "1", "NUM_GPUS_PER_WORKER": "0", "CUDA_VISIBLE_DEVICES": "0,1"}, cwd=tmp_path)
    assert out.returncode == 2
    [message] = [l for l in out.stderr.splitlines() if l.startswith("error:")]
    assert "this node has 2" in message and "CPU_RANKS=2 bash finetune_cogvlm.sh" in message
    assert "must be at least 1" not in message


@pytest.mark.parametrize("kind", ["cogvlm", "cogagent"])
def test_cpu_ranks_in_a_checkout_prepare_train_the_checkouts_demo_and_verify(tmp_path, kind):
    checkout, script = checkout_with_script(tmp_path, kind)
    out = run(script, {"DRY_RUN": "1", "CPU_RANKS": "2"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mode checkout-cpu, MP_SIZE=2" in out.stdout
    work = str(tmp_path / "sat_patches_demo" / f"checkout-{kind}")
    lines = [l for l in out.stdout.splitlines() if l.startswith("+ ")]
    assert lines[0] == f"+ cd {work}"
    assert f"-m sat_patches.runner.checkout_cpu prepare --checkout {checkout} --kind {kind} --workdir {work}" in lines[1]
    train = lines[2]
    assert "-m torch.distributed.run --nproc-per-node 2 --master-port " in train
    assert f"-m sat_patches.launch {checkout}/finetune_demo/finetune_{kind}_demo.py " in train
    for option in ("--model-parallel-size 2", f"--from_pretrained {work}/model", f"--local_tokenizer {work}/tokenizer",
                   f"--train-data {work}/data/train", "--train-iters 4", "--use_lora",
                   f"{work}/checkpoints/cpu_demo.global_batch4.micro_batch4.accumulation1.json"):
        assert option in train
    assert "--checkpoint-activations" not in train
    assert f"-m sat_patches.runner.checkout_cpu verify --checkout {checkout} --kind {kind} --workdir {work} --mp 2" \
        in lines[3]
    # a dry run writes nothing but the DeepSpeed config its commands name (they can be run as printed)
    assert os.listdir(work) == ["checkpoints"] and len(os.listdir(os.path.join(work, "checkpoints"))) == 1


def test_a_resumed_checkout_cpu_run_uses_its_prepared_work_dir_again(tmp_path):
    """RESUME continues a run in WORK_DIR: its model, tokenizer and data are used again rather than prepared anew;
    a WORK_DIR without them is prepared as for a new run."""
    checkout, script = checkout_with_script(tmp_path, "cogvlm")
    work = tmp_path / "work"
    run_dir = work / "checkpoints" / "finetune-tiny-cogvlm-1"
    (run_dir / "2").mkdir(parents=True)
    (run_dir / "latest").write_text("2")
    settings = {"DRY_RUN": "1", "CPU_RANKS": "2", "WORK_DIR": str(work), "RESUME": str(run_dir)}

    def step_lines():
        out = run(script, settings, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout, [l for l in out.stdout.splitlines() if l.startswith("+ ") and "-m " in l]

    said, lines = step_lines()
    assert "checkout_cpu prepare" in lines[0] and "RESUME: the model" not in said
    for d in ("model", "tokenizer", "data/train", "data/valid"):
        (work / d).mkdir(parents=True)
    (work / "model" / "latest").write_text("1")
    said, lines = step_lines()
    assert f"note: RESUME: the model, tokenizer and data prepared in {work} are used again" in said, said
    assert "-m torch.distributed.run" in lines[0] and f"--mode pretrain --load {run_dir}" in lines[0], lines
    assert not any("checkout_cpu prepare" in l for l in lines) and "checkout_cpu verify" in lines[-1]


def test_checkout_cpu_run_refuses_an_mp_size_the_ranks_cannot_hold(tmp_path):
    _, script = checkout_with_script(tmp_path, "cogvlm")
    out = run(script, {"DRY_RUN": "1", "CPU_RANKS": "2", "MP_SIZE": "4"}, cwd=tmp_path)
    assert out.returncode == 2
    assert "MP_SIZE=4 does not divide the world size 2 (CPU_RANKS=2 x NNODES=1)" in out.stderr


def assert_checkout_cpu_run_succeeded(out, work, kind, iters=4, mp=2):
    """Trained ``iters`` steps, saved one shard per rank, the demo merged and saved, the merge reloads; the
    checkout's mixins were patched (``sat-patches status``) with outputs unchanged."""
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    losses = [float(x) for x in re.findall(rf"^iteration \d+/{iters} \| loss ([0-9.]+) \|", out.stdout, re.M)]
    assert len(losses) == iters and all(0 < l < 20 for l in losses), losses
    shards = [f"mp_rank_{r:02d}_model_states.pt" for r in range(mp)]
    [trained] = [d for d in os.listdir(os.path.join(work, "checkpoints")) if d.startswith(f"finetune-tiny-{kind}")]
    saved = os.listdir(os.path.join(work, "checkpoints", trained, str(iters)))
    assert set(shards) <= set(saved), saved
    merged = os.path.join(work, "checkpoints", "merged_lora_cogvlm56" if kind == "cogvlm" else "merged_lora_cogagent")
    assert sorted(f for f in os.listdir(os.path.join(merged, "1")) if f.startswith("mp_rank_")) == shards
    assert log.count("merge layer 0 lora attention back to linear") >= 2  # the demo's merge_lora ran
    assert os.listdir(os.path.join(work, "merged_mp1", "1")) == ["mp_rank_00_model_states.pt"]
    assert re.search(r"loaded into the checkout's FineTuneTrain\w+Model: loss [0-9.]+ on CAPTCHA '\w+'", log), log[-3000:]
    # the checkout's own vision-expert mixins ran with sat_patches' routing, and give what their own routing gives
    assert re.search(r"mixins: fork_expert_routing_mlp applied, fork_expert_routing_attention applied; loss with "
                     r"the checkout's own routing [0-9.]+, patched [0-9.]+", log), log[-3000:]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(not os.environ.get("SAT_PATCHES_COGVLM_CHECKOUT"),
                    reason="set SAT_PATCHES_COGVLM_CHECKOUT to a CogVLM checkout (or a fork) to run its own demo")
def test_a_real_checkouts_cogvlm_demo_trains_on_two_cpu_ranks_and_merges(tmp_path):
    """The same run on a real checkout: its finetune_demo/ and utils/ are copied (the checkout is left
    as it is) and the script is added. The checkout's own requirements must be importable."""
    source = os.environ["SAT_PATCHES_COGVLM_CHECKOUT"]
    checkout = tmp_path / "CogVLM"
    for part in ("finetune_demo", "utils"):
        shutil.copytree(os.path.join(source, part), checkout / part)
    shutil.copy(SCRIPTS["cogvlm"], checkout / "finetune_demo")
    pythonpath = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    out = run(str(checkout / "finetune_demo" / "finetune_cogvlm.sh"), {"CPU_RANKS": "2", "PYTHONPATH": pythonpath},
              cwd=tmp_path, timeout=900)
    assert_checkout_cpu_run_succeeded(out, str(tmp_path / "sat_patches_demo" / "checkout-cogvlm"), "cogvlm")


def test_cpu_ranks_choose_the_cpu_run_where_gpus_are_visible(tmp_path):
    """Outside a checkout (the standalone demo) and inside one: CPU_RANKS set means CPU ranks."""
    out = run(SCRIPTS["cogvlm"], {"DRY_RUN": "1", "CPU_RANKS": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mode cpu, MP_SIZE=2" in out.stdout and "+ deepspeed" not in out.stdout
    _, script = checkout_with_script(tmp_path, "cogvlm")
    out = run(script, {"DRY_RUN": "1", "CPU_RANKS": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mode checkout-cpu, MP_SIZE=2" in out.stdout and "+ deepspeed" not in out.stdout
