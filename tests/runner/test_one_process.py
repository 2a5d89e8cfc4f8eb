"""sat_patches.runner.one_process: a CPU run's steps from one interpreter (its verbs in it, torchrun its child), each
printed as the command line that runs it alone; a failing step stops the rest with its status. (The runs end to end,
whose output these lines are part of, are tests/runner/test_finetune_scripts.py's and the checkout tests'.)"""
import json
import os
import sys

import pytest

from sat_patches.runner import finetune_run, one_process


@pytest.fixture(autouse=True)
def master_port_restored(monkeypatch):
    """``main`` gives the verbs it runs their own ``MASTER_PORT`` in ``os.environ`` (its own process's, in a run;
    this worker's here): put back after each test."""
    monkeypatch.setenv("MASTER_PORT", os.environ.get("MASTER_PORT", "29500"))


def test_a_cpu_run_has_one_interpreter_for_its_steps_and_a_gpu_run_runs_each_alone(tmp_path):
    env = dict(finetune_run.settings({"MODEL_KIND": "cogagent", "CPU_RANKS": "2"}), MASTER_PORT="1")
    commands = finetune_run.cpu_commands(env, "cogagent")
    [group] = finetune_run.steps(commands)
    assert group == commands and [cmd[2:4] for cmd in group] == [
        ["sat_patches", "finetune"], ["sat_patches.runner.cpu_ranks", "--nproc-per-node"], ["sat_patches", "merge"],
        ["sat_patches", "finetune"], ["sat_patches", "export"]]
    assert group[0][4] == "prepare" and group[3][4] == "verify"
    assert group[2][4] == one_process.latest_run_under(os.path.join(env["WORK_DIR"], "checkpoints"))
    line = one_process.command(group)
    assert line[:3] == [sys.executable, "-m", "sat_patches.runner.one_process"] and json.loads(line[3]) == group
    checkout = tmp_path / "CogVLM" / "finetune_demo"
    checkout.mkdir(parents=True)
    env.update(SCRIPT_DIR=str(checkout), WORK_DIR=str(tmp_path / "work"))
    [group] = finetune_run.steps(finetune_run.checkout_cpu_commands(env, "cogagent"))
    assert [cmd[2] for cmd in group] == ["sat_patches.runner.checkout_cpu", "sat_patches.runner.cpu_ranks",
                                         "sat_patches.runner.checkout_cpu"]
    gpu = dict(finetune_run.settings({"MODEL_KIND": "cogvlm", "NUM_GPUS_PER_WORKER": "1"}), MASTER_PORT="1")
    commands = finetune_run.gpu_commands(gpu, "cogvlm", checkout=False)
    assert finetune_run.steps(commands) == [[cmd] for cmd in commands]
    with pytest.raises(ValueError, match="no verb"):
        one_process.command([[sys.executable, "-m", "torch.distributed.run"]])


def test_a_child_step_has_the_runs_environment_and_the_verbs_their_own_port(tmp_path, monkeypatch, capsys):
    """torchrun (a child) gets the environment the runner gave, its MASTER_PORT included; the verbs run here
    another port (SAT's one-process group of ``prepare`` holds its port while the child trains). A merge's run
    is the newest run under the save directory when the merge starts, after the child wrote it (upstream's
    demo's merged save beside it is not a run)."""
    from sat_patches.cli import main
    saves = tmp_path / "checkpoints"
    child = ("import os, pathlib, time; saves = pathlib.Path(r'%s')\n"
             "for name in ('run-2', 'merged_lora_cogvlm'):  # the demo's merged save comes last, and is no run\n"
             "    (saves / name).mkdir(parents=True); (saves / name / 'latest').write_text('1'); time.sleep(0.05)\n"
             "print('child port', os.environ['MASTER_PORT'])" % saves)
    seen = {}

    def merged(argv):
        seen.update(run=argv[0], port=os.environ["MASTER_PORT"])
        return 0
    monkeypatch.setitem(main.OWN_PARSER, "merge", merged)
    monkeypatch.setenv("MASTER_PORT", "29511")
    (saves / "run-1").mkdir(parents=True)
    (saves / "run-1" / "latest").write_text("1")
    steps = [[sys.executable, "-c", child], [sys.executable, "-m", "sat_patches", "merge",
                                            one_process.latest_run_under(str(saves)), "out"]]
    assert one_process.main([json.dumps(steps)]) == 0
    out = capsys.readouterr().out
    assert seen["run"] == str(saves / "run-2") and seen["port"] != "29511", seen
    assert f"+ {sys.executable} -m sat_patches merge {saves / 'run-2'} out" in out.splitlines()


def test_each_step_is_printed_before_it_runs_and_a_failure_stops_the_rest(capsys):
    py = sys.executable
    steps = [[py, "-m", "sat_patches", "merge", "--help"], [py, "-m", "sat_patches", "finetune", "nosuchverb"],
             [py, "-m", "sat_patches", "export", "hf", "a", "b"]]
    assert one_process.main([json.dumps(steps)]) == 2
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"+ {py} -m sat_patches merge --help" and "usage:" in lines[1]  # argparse's exit 0: goes on
    assert lines[-1] == f"+ {py} -m sat_patches finetune nosuchverb" and "export" not in out
    assert "usage: sat-patches finetune {prepare,train,verify}" in err
    assert err.splitlines()[-1] == f"error: step failed with exit code 2: {py} -m sat_patches finetune ..."


def test_an_exception_in_a_step_is_printed_with_status_1(capsys, monkeypatch):
    from sat_patches.cli import main

    def broken(argv):
        raise RuntimeError("broken " + " ".join(argv))
    monkeypatch.setitem(main.OWN_PARSER, "merge", broken)
    assert one_process.main([json.dumps([[sys.executable, "-m", "sat_patches", "merge", "x"]])]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: broken x" in err and "step failed with exit code 1" in err


def test_only_this_interpreters_python_m_verbs_share_it():
    assert one_process.verb_module([sys.executable, "-m", "sat_patches", "export", "hf"]) == "sat_patches.cli.main"
    assert one_process.verb_module([sys.executable, "-m", "sat_patches.runner.checkout_cpu", "verify"]) == \
        "sat_patches.runner.checkout_cpu"
    for cmd in ([sys.executable, "-m", "torch.distributed.run"], ["/other/python", "-m", "sat_patches", "merge"]):
        assert one_process.verb_module(cmd) == ""
