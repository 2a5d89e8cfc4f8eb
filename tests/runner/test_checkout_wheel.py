"""From a wheel, in an environment that shares nothing with this repository: the drop-in script in a
(synthetic) CogVLM checkout names a DeepSpeed config that exists for a GPU run, and with CPU_RANKS=2
runs the checkout's CogAgent demo on two CPU ranks at MP=2 in the shared-GPU mode, saves both shards and runs the
demo's merge."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from fake_checkout import write_fake_checkout
from isolated import dependencies_without_us, tracked_copy
from test_checkout_cpu import assert_checkout_cpu_run_succeeded

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """``(python, env)`` of a fresh virtual environment with the project's wheel installed."""
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels, deps, venv = tmp / "src", tmp / "wheels", tmp / "deps", tmp / "venv"
    tracked_copy(ROOT, str(src))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                          str(src)], capture_output=True, text=True, cwd=tmp, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    [wheel] = [str(p) for p in wheels.glob("sat_patches-*.whl")]
    dependencies_without_us(str(deps))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "CPU_RANKS", "NUM_GPUS_PER_WORKER",
                        "MP_SIZE", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(deps), PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PATH=os.pathsep.join([str(venv / "bin")] + [p for p in os.environ.get("PATH", "").split(os.pathsep)
                                                          if not os.path.isfile(os.path.join(p, "nvidia-smi"))]))
    out = subprocess.run([python, "-m", "pip", "install", "--no-deps", wheel], capture_output=True, text=True,
                         env=env, cwd=tmp, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    where = subprocess.run([python, "-c", "import sat_patches; print(sat_patches.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp, timeout=300)
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel's copy, not the repository's
    return python, env


def _checkout(python, env, dest, script="finetune_cogvlm.sh"):
    """The synthetic checkout (the suite's stand-in for a CogVLM fork) with only ``script`` added, written there by
    the installed package's ``sat-patches scripts``."""
    write_fake_checkout(str(dest))
    scripts = dest.parent / "scripts"
    out = subprocess.run([python, "-m", "sat_patches", "scripts", str(scripts)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shutil.copy(scripts / script, dest / "finetune_demo")
    return str(dest / "finetune_demo" / script)


@pytest.mark.slow
def test_wheel_in_a_checkout_names_an_existing_deepspeed_config_with_the_micro_batch(wheel_env, tmp_path):
    python, env = wheel_env
    script = _checkout(python, env, tmp_path / "CogVLM")
    run_env = dict(env, DRY_RUN="1", CUDA_VISIBLE_DEVICES="0,1", NUM_GPUS_PER_WORKER="2", MP_SIZE="2", MICRO_BATCH="2")
    out = subprocess.run(["bash", script], capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mode checkout," in out.stdout
    [cmd] = [l for l in out.stdout.splitlines() if l.startswith("+ deepspeed")]
    assert f"--module sat_patches.launch {tmp_path}/CogVLM/finetune_demo/finetune_cogvlm_demo.py " in cmd
    path = re.search(r"--deepspeed_config (\S+)", cmd).group(1)
    assert os.path.isfile(path), path
    with open(path) as f:
        assert json.load(f)["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.slow
@pytest.mark.multirank
def test_wheel_in_a_checkout_trains_cogagents_demo_on_two_cpu_ranks_with_every_collective_relayed(wheel_env, tmp_path):
    """The user's path (this is the suite's one end-to-end run of a checkout's CogAgent demo): CogAgent's cross
    encoder trains in its demo, two steps under DeepSpeed ZeRO-2 at MP=2, and one evaluation at the end (the
    demo's evaluation step uses its module-level tokenizer, which exists only when the demo runs as ``__main__``).
    The run also has SAT_PATCHES_SHARED_GPU=1, the debugging mode for several ranks on one GPU: on CPU ranks there
    is no GPU to share, the run says so once, and every collective passes through the host relay's process group.
    (CogVLM's checkout demo runs end to end in the GPU kit's tiny run, tests/benchmarks/test_gpu_kit_fork.py.)"""
    python, env = wheel_env
    script = _checkout(python, env, tmp_path / "CogVLM", "finetune_cogagent.sh")
    run_env = dict(env, CPU_RANKS="2", TRAIN_ITERS="2", EVAL_INTERVAL="2", EXTRA_ARGS="--eval-iters 1",
                   SAT_PATCHES_SHARED_GPU="1")
    out = subprocess.run(["bash", script], capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=900)
    assert re.search(r"\+ \S*/venv/bin/python -m torch\.distributed\.run --nproc-per-node 2 ", out.stdout), \
        out.stdout[-3000:]
    assert_checkout_cpu_run_succeeded(out, str(tmp_path / "sat_patches_demo" / "checkout-cogagent"), "cogagent",
                                      iters=2)
    assert re.search(r"validation loss at iteration 2 \| loss: \S+ \| PPL: \S+ acc ", out.stdout + out.stderr)
    said = re.findall(r"^sat_patches: SAT_PATCHES_SHARED_GPU=1 \(process group backend '(\w+)'\): no GPU to share "
                      r"on CPU ranks", out.stdout, re.M)
    assert said == ["hostrelay"], out.stdout[-3000:]  # the training run's, once
