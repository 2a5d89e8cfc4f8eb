"""``sat-patches doctor``: every check passes on good facts and fails (saying what to do) on bad ones."""
import json

import pytest

from sat_patches.cli import doctor_checks, doctor_facts
from sat_patches.cli.doctor_checks import FAIL, INFO, OK, WARN
from sat_patches.cli.doctor_facts import Facts

A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 85.1, "driver": "535.104.05"}
V3090 = {"name": "NVIDIA GeForce RTX 3090", "memory_gb": 25.4, "driver": "535.104.05"}


def gpu_box(**kw):
    """A healthy 8 x A100 node."""
    facts = dict(env={}, cuda_available=True, gpus=[dict(A100) for _ in range(8)], smi_gpus=8, bnb_cuda=True,
                 ninja="/usr/bin/ninja", host_total_gb=1000.0, host_available_gb=900.0,
                 versions={"python": "3.11.7", "torch": "2.4.0+cu121", "torch_cuda": "12.1", "nccl": "2.20.5",
                           "sat": "0.4.12", "deepspeed": "0.14.4", "bitsandbytes": "0.43.1", "matplotlib": "3.9.0",
                           "transformers": "4.41.2", "accelerate": "0.30.1", "sat_patches": "0.1.0"},
                 net_interfaces=["eth0", "ib0", "lo"],
                 patches=[{"name": "process_group_backend", "status": "applied", "reason": ""}])
    facts.update(kw)
    return Facts(**facts)


def cpu_box(**kw):
    facts = gpu_box(cuda_available=False, gpus=[], smi_gpus=None, bnb_cuda=False, ninja=None)
    facts.versions.update(torch="2.13.0+cpu", torch_cuda=None, nccl=None)
    for k, v in kw.items():
        setattr(facts, k, v)
    return facts


def with_versions(**versions):
    f = gpu_box()
    f.versions.update(versions)
    return f


def with_env(**env):
    return gpu_box(env=env)


# (check, good facts, bad facts, words the failure must contain, status of the failure)
CASES = [
    ("torch", gpu_box(), gpu_box(cuda_available=False, gpus=[]), "cannot use the 8 GPU", FAIL),
    ("torch", gpu_box(), with_versions(torch_cuda=None), "CPU build but nvidia-smi lists 8", FAIL),
    ("nccl", gpu_box(), with_versions(nccl=None), "torch has no NCCL", FAIL),
    ("sat", gpu_box(), with_versions(sat=None), "not installed", FAIL),
    ("sat", gpu_box(), with_versions(sat="0.4.10"), "verified on 0.4.12", WARN),
    ("deepspeed", gpu_box(), with_versions(deepspeed=None), "pip install deepspeed", FAIL),
    ("bitsandbytes", gpu_box(), gpu_box(bnb_cuda=False), "no working CUDA binary", WARN),
    ("bitsandbytes", gpu_box(), with_versions(bitsandbytes=None), "QLoRA", WARN),
    ("ninja", gpu_box(), gpu_box(ninja=None), "pip install ninja", WARN),
    ("gpus", gpu_box(), gpu_box(gpus=[dict(A100)] * 4 + [dict(V3090)] * 4), "mixed GPUs", WARN),
    ("gpus", gpu_box(), gpu_box(gpus=[dict(A100), dict(A100, driver="550.54.14")]), "one driver", WARN),
    ("host memory", gpu_box(host_needed_gb=300.0), gpu_box(host_available_gb=50.0, host_needed_gb=300.0),
     "sat-patches plan --host-mem", FAIL),
    ("ranks env", with_env(LOCAL_WORLD_SIZE="8", WORLD_SIZE="8"),
     with_env(LOCAL_WORLD_SIZE="8", CUDA_VISIBLE_DEVICES="0,1"), "LOCAL_WORLD_SIZE=8 but 2 GPU(s) are visible", FAIL),
    ("ranks env", gpu_box(deepspeed_env={"LOCAL_WORLD_SIZE": "8"}),
     gpu_box(deepspeed_env={"LOCAL_WORLD_SIZE": "8"}, env={"CUDA_VISIBLE_DEVICES": "0,1"}), ".deepspeed_env", FAIL),
    ("ranks env", with_env(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8"), with_env(WORLD_SIZE="12", LOCAL_WORLD_SIZE="8"),
     "not a multiple", FAIL),
    ("ranks env", with_env(RANK="3", WORLD_SIZE="8"), with_env(RANK="8", WORLD_SIZE="8"), "RANK=8", FAIL),
    ("ranks env", with_env(CUDA_VISIBLE_DEVICES="6,7"), with_env(CUDA_VISIBLE_DEVICES="7,8"), "names GPU 8", FAIL),
    ("hostfile", gpu_box(hostfile_text="node1 slots=8\nnode2 slots=8\n"), gpu_box(hostfile_text="node1 8 gpus\n"),
     "hostname slots=", FAIL),
    ("hostfile", gpu_box(hostfile_text=None), gpu_box(hostfile_error="Permission denied"), "Permission denied", FAIL),
    ("nccl/alloc env", with_env(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128", NCCL_SOCKET_IFNAME="eth"),
     with_env(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb=128"), "not option:value", FAIL),
    ("nccl/alloc env", with_env(NCCL_SOCKET_IFNAME="^lo,docker"), with_env(NCCL_SOCKET_IFNAME="enp1s0"),
     "matches no interface", FAIL),
    ("nccl/alloc env", with_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="1"), with_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"),
     "never aborts", WARN),
    ("nccl/alloc env", with_env(), with_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segment:True"), "unknown", WARN),
    ("hang dumps", with_env(SAT_PATCHES_COLLECTIVE_TIMEOUT="600"), with_env(SAT_PATCHES_COLLECTIVE_TIMEOUT="ten"),
     "positive number of seconds", FAIL),
    ("settings", with_env(SAT_PATCHES_LEDGER="0"), with_env(SAT_PATCHES_TRUST_CHECKPOINTS="false"),
     "SAT_PATCHES_TRUST_CHECKPOINTS='false': set it to 1", FAIL),
    ("settings", with_env(SAT_PATCHES_LEDGER="0"), with_env(SAT_PATCHES_LEDGR="0"), "unknown setting(s) SAT_PATCHES_LEDGR",
     WARN),
    ("patches", gpu_box(), gpu_box(patches=[{"name": "lora_linear", "status": "skipped", "reason": "differs"}]),
     "sat-patches status", WARN),
    ("report", gpu_box(), with_versions(matplotlib=None), "sat_patches[report]", WARN),
    # the pair measured to break the README's 4-bit recipe, and the fix: the hf extra
    ("hf recipes", gpu_box(), with_versions(accelerate="1.15.0"), 'pip install "sat_patches[hf]"', WARN),
    ("hf recipes", with_versions(transformers="4.38.2", accelerate="0.27.2"), with_versions(accelerate="1.0.0rc1"),
     "transformers 4.41.2 and accelerate 1.15.0", WARN),
]


def _check(name, facts):
    [check] = [c for c in doctor_checks.run(facts) if c.name == name]
    return check


@pytest.mark.parametrize("name, good, bad, words, status", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_check_passes_and_fails_with_what_to_do(name, good, bad, words, status):
    ok = _check(name, good)
    assert ok.status in (OK, INFO), ok
    failed = _check(name, bad)
    assert failed.status == status, failed
    assert words in failed.summary + " " + failed.fix
    assert failed.fix, "every problem says what to do"


def test_every_check_has_a_case():
    assert {c[0] for c in CASES} == {check(gpu_box()).name for check in doctor_checks.CHECKS}


def test_hf_recipes_outside_the_breaking_pair_say_what_is_installed():
    """In the tested set: ok. transformers 5.x, or one too new for the pair, or none: information, with the extra."""
    assert _check("hf recipes", gpu_box()).status == OK
    for versions, words in (({"transformers": "5.24.0", "accelerate": "1.15.0"}, "released CogVLM code needs 4.x"),
                            ({"transformers": "4.46.0", "accelerate": "1.15.0"}, "were run with 4.41.2 and 0.30.1"),
                            ({"transformers": None, "accelerate": None}, "no transformers")):
        check = _check("hf recipes", with_versions(**versions))
        assert check.status == INFO and words in check.summary, check
        assert 'pip install "sat_patches[hf]"' in check.summary


def test_cpu_only_machine_has_no_blocking_problem():
    checks = doctor_checks.run(cpu_box())
    assert not [c for c in checks if c.status == FAIL], checks
    by_name = {c.name: c for c in checks}
    assert "CPU over gloo" in by_name["torch"].summary and by_name["nccl"].status == INFO
    assert by_name["ninja"].status == INFO  # torch's Adam on CPU ranks: no g++ build


def test_host_memory_against_the_plan_for_the_model():
    facts = gpu_box(gpus=[dict(V3090) for _ in range(8)], host_available_gb=20.0)
    doctor_facts.plan_host_need(facts, "cogvlm-base-490", None, None)
    assert facts.host_needed_gb > 20 and "MP_SIZE=2" in facts.host_needed_note
    assert _check("host memory", facts).status == FAIL


def test_doctor_on_this_machine_one_screen_json_and_exit_status(capsys, monkeypatch, tmp_path):
    from sat_patches.cli.main import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 42 and ("blocking" in out or "no problems found" in out)
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["blocking"] == 0 and {c["name"] for c in data["checks"]} >= {"torch", "sat", "patches"}
    (tmp_path / "hostfile").write_text("this is not a hostfile\n")
    assert main(["doctor"]) == 1
    assert "FAIL  hostfile" in capsys.readouterr().out


@pytest.mark.slow
def test_doctor_json_is_one_document_on_stdout_in_a_fresh_process(tmp_path):
    """A fresh process imports DeepSpeed (which logs to stdout at import) and bitsandbytes while it gathers; stdout
    holds the JSON document alone."""
    import os
    import subprocess
    import sys
    import sat_patches
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(sat_patches.__file__))),
               SAT_PATCHES_DISABLE="quiet_third_party",  # let DeepSpeed log its accelerator line at import,
               CUDA_VISIBLE_DEVICES="")  # which it logs only where it finds no GPU: none, on any machine
    env.pop("LOCAL_WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-m", "sat_patches", "doctor", "--json"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    data = json.loads(out.stdout)
    assert {c["name"] for c in data["checks"]} >= {"torch", "sat", "patches"}


def test_every_setting_is_the_librarys_and_has_its_line():
    """The settings table holds what the library reads; the test kit's own variables (tests/support) are not there."""
    from sat_patches.cli.doctor import format_settings
    from sat_patches.core import settings
    listed = format_settings(settings.table({}))
    assert all(f"  {name} " in listed for name in settings.SETTINGS)
    assert not {"SAT_PATCHES_TEST_FRESH", "SAT_PATCHES_IMPORT", "SAT_PATCHES_CWD"} & set(settings.SETTINGS)
    assert "test harness" not in listed
