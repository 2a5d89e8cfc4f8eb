"""A CPU run's steps, each a child process printed before it starts (``+ ...``), its ranks started by torchrun; a
failing step stops the rest with its status. (The runs end to end, whose output these lines are part of, are
tests/runner/test_finetune_scripts.py's and the checkout tests'.)"""
import os
import sys

from sat_patches.runner import finetune_run, steps


def test_a_cpu_runs_ranks_are_started_by_torchrun_through_sat_patches_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the commands write the run's DeepSpeed config under WORK_DIR
    env = dict(finetune_run.settings({"MODEL_KIND": "cogagent", "CPU_RANKS": "2"}), MASTER_PORT="29517")
    commands = finetune_run.cpu_commands(env, "cogagent")
    assert [cmd[:4] for cmd in commands] == [[sys.executable, "-m", *m] for m in (
        ("sat_patches", "finetune"), ("torch.distributed.run", "--nproc-per-node"), ("sat_patches", "merge"),
        ("sat_patches", "finetune"), ("sat_patches", "export"))]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
                "-m", "sat_patches.launch"]
    assert commands[1][:len(torchrun)] == torchrun
    assert commands[1][len(torchrun):len(torchrun) + 4] == ["-m", "sat_patches", "finetune", "train"]
    assert commands[2][4] == steps.latest_run_under(os.path.join(env["WORK_DIR"], "checkpoints"))
    checkout = tmp_path / "CogVLM" / "finetune_demo"
    checkout.mkdir(parents=True)
    env.update(SCRIPT_DIR=str(checkout), WORK_DIR=str(tmp_path / "work"))
    commands = finetune_run.checkout_cpu_commands(env, "cogagent")
    assert commands[1][:len(torchrun)] == torchrun
    assert commands[1][len(torchrun)] == str(checkout / "finetune_cogagent_demo.py")


def test_each_step_is_printed_before_it_runs_and_a_failure_stops_the_rest(tmp_path, capfd):
    py = sys.executable
    commands = [[py, "-c", "import os; print('child port', os.environ['MASTER_PORT'], flush=True)"],
                [py, "-c", "raise SystemExit(3)"], [py, "-c", f"open(r'{tmp_path / 'ran'}', 'w')"]]
    assert steps.run(commands, dict(os.environ, MASTER_PORT="29511")) == 3
    out, err = capfd.readouterr()
    assert out.splitlines()[:2] == [steps.step_line(commands[0]), "child port 29511"]  # the run's environment
    assert out.splitlines()[-1] == steps.step_line(commands[1]) and not (tmp_path / "ran").exists()
    assert err.splitlines()[-1] == f"error: step failed with exit code 3: {py} -c raise SystemExit(3) ..."


def test_a_runs_directory_is_the_newest_under_the_save_directory_when_its_step_starts(tmp_path, capfd):
    """The merge's run is the newest run under the save directory when the merge starts, after training wrote it
    (upstream's demo's merged save beside it is not a run); a dry run prints the steps as given, runs none."""
    saves = tmp_path / "checkpoints"
    (saves / "run-1").mkdir(parents=True)
    (saves / "run-1" / "latest").write_text("1")
    train = ("import pathlib, time; saves = pathlib.Path(r'%s')\n"
             "for name in ('run-2', 'merged_lora_cogvlm'):  # the demo's merged save comes last, and is no run\n"
             "    time.sleep(0.05); (saves / name).mkdir(); (saves / name / 'latest').write_text('1')\n" % saves)
    merge = [sys.executable, "-c", "import sys; print('merging', sys.argv[1])", steps.latest_run_under(str(saves))]
    assert steps.run([[sys.executable, "-c", train], merge], dict(os.environ), dry_run=True) == 0
    assert capfd.readouterr().out.splitlines()[-1] == steps.step_line(merge)
    assert not (saves / "run-2").exists()
    assert steps.run([[sys.executable, "-c", train], merge], dict(os.environ)) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[-2:] == [steps.step_line(merge[:3] + [str(saves / "run-2")]), f"merging {saves / 'run-2'}"]


def test_a_run_that_wrote_no_checkpoint_stops_before_the_step_that_needs_it(tmp_path, capfd):
    merge = [sys.executable, "-c", "pass", steps.latest_run_under(str(tmp_path))]
    assert steps.run([merge], dict(os.environ)) == 1
    out, err = capfd.readouterr()
    assert out == "" and f"error: training wrote no checkpoint under {tmp_path}" in err
