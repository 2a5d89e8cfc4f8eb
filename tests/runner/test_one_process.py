"""sat_patches.runner.one_process: the CPU demo's follow-up steps share one interpreter, each printed as the command
line that runs it alone; a failing step stops the rest with its status. (The demo end to end, whose output these
lines are part of, is tests/runner/test_finetune_scripts.py's.)"""
import json
import sys

from sat_patches.runner import finetune_run, one_process


def test_the_cpu_demo_runs_merge_verify_and_export_in_one_interpreter_and_every_other_step_alone():
    env = dict(finetune_run.settings({"MODEL_KIND": "cogagent", "CPU_RANKS": "2"}), MASTER_PORT="1")
    commands = finetune_run.cpu_commands(env, "cogagent")
    groups = finetune_run.steps(commands)
    assert [[cmd[2] for cmd in group] for group in groups] == [
        ["sat_patches.finetune"], ["torch.distributed.run"],
        ["sat_patches.merge", "sat_patches.finetune", "sat_patches.export"]]
    assert [cmd for group in groups for cmd in group] == commands  # in their order, none left out
    assert groups[0][0][3] == "prepare" and groups[2][1][3] == "verify"
    line = one_process.command(groups[2])
    assert line[:3] == [sys.executable, "-m", "sat_patches.runner.one_process"] and json.loads(line[3]) == groups[2]


def test_each_step_is_printed_before_it_runs_and_a_failure_stops_the_rest(capsys):
    py = sys.executable
    steps = [[py, "-m", "sat_patches.merge", "--help"], [py, "-m", "sat_patches.finetune", "nosuchverb"],
             [py, "-m", "sat_patches.export", "hf", "a", "b"]]
    assert one_process.main([json.dumps(steps)]) == 2
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"+ {py} -m sat_patches.merge --help" and "usage:" in lines[1]  # argparse's exit 0: goes on
    assert lines[-1] == f"+ {py} -m sat_patches.finetune nosuchverb" and "export" not in out
    assert "usage: sat-patches finetune {prepare,train,verify}" in err
    assert err.splitlines()[-1] == f"error: step failed with exit code 2: {py} -m sat_patches.finetune nosuchverb ..."


def test_an_exception_in_a_step_is_printed_with_status_1(capsys, monkeypatch):
    from sat_patches.cli import merge

    def broken(argv):
        raise RuntimeError("broken " + " ".join(argv))
    monkeypatch.setattr(merge, "main", broken)
    assert one_process.main([json.dumps([[sys.executable, "-m", "sat_patches.merge", "x"]])]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: broken x" in err and "step failed with exit code 1" in err


def test_only_this_interpreters_python_m_verbs_share_it():
    assert one_process.verb_module([sys.executable, "-m", "sat_patches.export", "hf"]) == "sat_patches.cli.export"
    for cmd in ([sys.executable, "-m", "torch.distributed.run"], ["/other/python", "-m", "sat_patches.merge"],
                [sys.executable, "-m", "sat_patches.runner.checkout_cpu", "verify"]):
        assert one_process.verb_module(cmd) == ""
