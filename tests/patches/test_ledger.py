"""The memory ledger on SAT's own training_main (tiny LoRA LLaMA, 2 CPU ranks), its report PNG, and
``sat-patches plan`` against what the ledger measures on a tiny and a mid-size model."""
import glob
import os
import re

import pytest

from sat_patches.diagnostics import ledger
from sat_patches.patches import ledger as ledger_patches
from sat_patches.diagnostics import ledger_files
from sat_patches.planning import memory, shapes
from multirank import run_ranks, run_script

SCRIPT = ["-m", "tiny_lora"]
MID = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--vocab-size", "32000",
       "--train-iters", "2", "--log-interval", "1"]
PHASES = ["start", "lora", "build", "deepspeed_init", "first_step"]


def saved_run(save: str) -> str:
    """The run directory SAT made under ``--save`` (``<experiment name>-<month-day-hour-minute>``)."""
    [run_dir] = glob.glob(os.path.join(save, "tiny-lora-*"))
    return run_dir


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("run"))
    # fresh interpreters: the ledger measures each rank's memory as a user's process has it
    results = run_script([*SCRIPT, "--save", save], nranks=2, timeout=300, fresh=True)
    for r in results:
        assert r.ok, r.output[-4000:]
    return saved_run(save), results


def test_run_directory_is_sat_save_dir():
    import argparse
    args = argparse.Namespace(save="checkpoints/finetune-cogvlm-base-490-11-22-10-00")
    assert ledger.run_directory(args) == args.save and ledger.run_directory(argparse.Namespace(save=None)) is None


def _sat_parameter_count(output):
    return int(re.search(r"number of parameters on model parallel rank 0: (\d+)", output).group(1))


def _lora_llama(layers, hidden, heads, vocab):
    """tiny_lora's model as model_config.json fields (SAT's LLaMA defaults: biases, 4h MLP)."""
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                inner_hidden_size=None, use_bias=True)


def _cpu_estimate(config, ranks):
    # tiny_lora: fp32 (SAT's default ZeRO-0 config), batch 4, 15 input tokens, LoRA rank 4, no checkpointing
    return memory.estimate(config, memory.Setup(gpus=ranks, mp=1, zero=0, dtype="fp32", micro_batch=4, seq_len=15,
                                            lora_rank=4, lora_eva=False, checkpoint_activations=False, device="cpu"))


@pytest.mark.slow  # the module's two-rank run in fresh processes
def test_training_main_writes_the_ledger_into_the_run_directory(tiny_run):
    run_dir, results = tiny_run
    rows = ledger_files.read(run_dir)
    for rank in (0, 1):
        phases = [r.phase for r in rows if r.rank == rank]
        assert phases[:5] == PHASES, phases
        assert [r.iteration for r in rows if r.rank == rank and r.phase == "step"] == [2, 4, 6, 8, 10, 12]
        assert all(r.rss_peak_mib >= r.rss_mib > 100 for r in rows if r.rank == rank)
    assert os.path.exists(os.path.join(run_dir, ledger_files.JSON_NAME))
    table = results[0].stdout
    assert "[sat_patches memory ledger] after the first step (iteration 1)" in table
    assert table.count("[sat_patches memory ledger]") == 1  # later intervals go to the files (no rank flagged)
    assert re.search(r"^\s+1  first_step\s+1\s+\d+\s+\d+$", table, re.M)  # rank 0 prints rank 1's row
    assert "[sat_patches memory ledger]" not in results[1].stdout


@pytest.mark.slow  # the module's two-rank run in fresh processes
def test_report_draws_one_line_per_rank(tiny_run, tmp_path):
    from report_png import assert_report_has_one_line_per_rank
    run_dir, _ = tiny_run
    assert_report_has_one_line_per_rank(run_dir, tmp_path / "ledger.png")


def test_ranks_with_the_same_memory_each_show_their_line(tmp_path):
    """Two ranks often hold the same RSS (a data-parallel run): the later rank's line is drawn over the earlier's,
    and each must still show in the chart."""
    from PIL import Image
    from report_png import RANK_COLOURS, pixels_near
    from sat_patches.diagnostics import charts
    rows = [ledger_files.Row(rank=k, phase=phase, iteration=it, time=float(t), elapsed=float(t), rss_mib=rss,
                             rss_peak_mib=rss)
            for k in (0, 1) for t, (phase, it, rss) in enumerate(
                [("start", 0, 300), ("build", 0, 320), ("deepspeed_init", 0, 360), ("first_step", 1, 400)] +
                [("step", it, 400 + it) for it in range(2, 12)])]
    ledger_files.write(str(tmp_path), rows, rows, fresh=True)
    pixels = list(Image.open(charts.draw(str(tmp_path))).convert("RGB").getdata())
    assert [pixels_near(pixels, colour) > 500 for colour in RANK_COLOURS[:2]] == [True, True]


@pytest.mark.slow  # the module's two-rank run in fresh processes
def test_plan_within_15_percent_of_the_ledger_on_the_tiny_model(tiny_run):
    run_dir, results = tiny_run
    config = _lora_llama(2, 64, 4, 1024)
    assert shapes.parameter_count(config, lora_rank=4, lora_eva=False) == _sat_parameter_count(results[0].output)
    estimate = _cpu_estimate(config, 2).cpu_rank / 2 ** 20
    for rank, peak in ledger_files.peaks(ledger_files.read(run_dir)).items():
        assert estimate == pytest.approx(peak["host"], rel=0.15), (rank, estimate, peak)


@pytest.mark.slow
def test_plan_within_15_percent_of_the_ledger_on_a_mid_size_model(tiny_run, tmp_path):
    [r] = run_script([*SCRIPT, *MID, "--save", str(tmp_path)], nranks=1, timeout=300, fresh=True)
    assert r.ok, r.output[-4000:]
    config = _lora_llama(4, 1024, 16, 32000)
    assert shapes.parameter_count(config, lora_rank=4, lora_eva=False) == _sat_parameter_count(r.output) > 1e8
    rows = ledger_files.read(saved_run(str(tmp_path)))
    estimate = _cpu_estimate(config, 1)
    peak = ledger_files.peaks(rows)[0]["host"]
    assert estimate.cpu_rank / 2 ** 20 == pytest.approx(peak, rel=0.15)
    # the model's own share (weights, LoRA, optimizer, activations) beside the process baseline: the tiny model's
    # peak less its own planned share (libraries SAT imports at their first use load after the ledger's "start")
    tiny = _cpu_estimate(_lora_llama(2, 64, 4, 1024), 2)
    base = ledger_files.peaks(ledger_files.read(tiny_run[0]))[0]["host"] - (tiny.cpu_rank - memory.HOST_BASE_CPU) / 2 ** 20
    assert (estimate.cpu_rank - memory.HOST_BASE_CPU) / 2 ** 20 == pytest.approx(peak - base, rel=0.15)


def test_a_rank_far_above_the_others_is_flagged():
    rows = [ledger_files.Row(rank=k, phase="build", iteration=0, time=0.0, elapsed=0.0, rss_mib=v, rss_peak_mib=v)
            for k, v in enumerate([2000, 2100, 1950, 9000])]
    flags = ledger_files.flagged(rows)
    assert list(flags["host"]) == [3] and not flags["cuda"]
    assert "! rank 3 is far above the others in host RSS" in ledger_files.format_table(rows, rows)
    assert not ledger_files.far_above({0: 500.0, 1: 520.0})   # ordinary spread


# --------------------------------------------------------------------------------------
# Each ledger patch records its phase, and does not without it (one CPU rank)
# --------------------------------------------------------------------------------------
def exercise_ledger_patches(run_dir):
    """Rank function: call each SAT function a ledger patch wraps, with and without that patch."""
    import argparse
    import torch
    import sat
    import sat.arguments
    from sat.model.base_model import get_model
    from sat.model.finetune.lora2 import LoraMixin
    from sat.model.official.llama_model import LLaMAModel
    from sat.mpu import operation
    from sat.training import deepspeed_training as dt
    from sat.training import model_io
    from sat.training.utils import Timers
    from patching import patches_removed
    import tiny_lora
    from expert_llama import write_checkpoint

    cls = tiny_lora.model_class()
    args = sat.get_args(tiny_lora.DEFAULT_ARGS, cls.add_model_specific_args(argparse.ArgumentParser()))
    args.save = run_dir  # where the first step's flush writes the table
    rows = ledger.LEDGER.rows
    results = {}

    def check(name, call):
        """Phases recorded by ``call()`` with every patch, then with patch ``name`` removed."""
        seen = []
        for removed in ((), (name,)):
            rows[:] = [r for r in rows if r.phase != "start"]  # "start" is recorded once per process
            before = len(rows)
            with patches_removed(*removed) if removed else _nothing():
                call()
            seen.append([r.phase for r in rows[before:]])
        results[name] = seen

    check("ledger_start", lambda: sat.arguments.initialize_distributed(args))
    model = get_model(args, cls)
    check("ledger_build", lambda: get_model(args, cls))
    check("ledger_lora", lambda: get_model(args, LLaMAModel).add_mixin(
        "lora", LoraMixin(args.num_layers, 4), reinit=True))
    folder = os.path.join(run_dir, "ckpt")
    write_checkpoint(model, {"model_class": "TinyLoraLLaMA", "num_layers": 2, "hidden_size": 64,
                             "num_attention_heads": 4, "vocab_size": 1024, "max_sequence_length": 64}, folder)
    check("ledger_load", lambda: model_io.load_checkpoint(model, args, load_path=folder))
    check("ledger_from_pretrained", lambda: cls.from_pretrained(folder, args))
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    check("ledger_split_rank0", lambda: operation.mp_split_model_rank0(plain, plain, use_node_group=False))
    check("ledger_split_receive", lambda: operation.mp_split_model_receive(torch.nn.Module(), use_node_group=False))
    no_data = argparse.Namespace(**{**vars(args), "train_data": None})
    check("ledger_deepspeed_init", lambda: dt.setup_model_untrainable_params_and_optimizer(no_data, model))

    class Engine:  # what train_step asks of DeepSpeed's engine
        def backward(self, loss): loss.backward()
        def is_gradient_accumulation_boundary(self): return True
        def step(self): pass

    class Scheduler:
        def step(self): pass
    weight = torch.nn.Parameter(torch.ones(1))
    forward = lambda it, m, a, t: (weight * 2).sum()  # noqa: E731
    check("ledger_train_step", lambda: dt.train_step(iter([None]), Engine(), None, Scheduler(), args, Timers(),
                                                       hooks={"forward_step": forward}))
    return results


class _nothing:
    def __enter__(self): return self
    def __exit__(self, *exc): return False


@pytest.mark.slow  # every ledger patch, each on and off (over 10 s)
def test_each_ledger_patch_records_its_phase_and_not_without_it(tmp_path):
    [r] = run_ranks(exercise_ledger_patches, 1, args=(str(tmp_path),), timeout=240)
    assert r.ok, (r.exception or r.output)[-4000:]
    expected = {"ledger_start": "start", "ledger_build": "build", "ledger_lora": "lora", "ledger_load": "load",
                "ledger_from_pretrained": "load", "ledger_split_rank0": "split", "ledger_split_receive": "split",
                "ledger_deepspeed_init": "deepspeed_init", "ledger_train_step": "first_step"}
    assert set(r.result) == {p.name for p in ledger_patches.PATCHES}
    for name, phase in expected.items():
        with_patch, without = r.result[name]
        assert phase in with_patch and phase not in without, (name, r.result[name])
    assert os.path.exists(tmp_path / ledger_files.CSV_NAME)  # the first step flushed the table
