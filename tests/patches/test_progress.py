"""One short line per logged step with an ETA, and the loss curve beside the memory ledger."""
import argparse
import logging

import pytest

from sat_patches.diagnostics.charts import CURVE_CSV, CURVE_PNG
from sat_patches.diagnostics.progress import progress_line
from patching import patches_removed


def _report(tmp_path, step):
    from sat.training.deepspeed_training import report_iteration_metrics
    args = argparse.Namespace(fp16=False, deepspeed=True, wandb=False, gradient_accumulation_steps=1, batch_size=4,
                              model_parallel_size=1, save=str(tmp_path))
    report_iteration_metrics(None, None, 1e-4, 6.5 - step / 10, 1320.0, step, 20, args, {"loss": 6.5, "acc": 0.25})


def test_progress_line_has_iteration_loss_speed_and_eta():
    line = progress_line(4, 20, 6.52134, 1e-4, 1320.0, {"loss": 6.52134, "acc": 0.25})
    assert line == "iteration 4/20 | loss 6.5213 | lr 1.00e-04 | 1.32 s/it | ETA 0:00:21 | acc 0.2500"


def test_sat_line_replaced_and_curve_written(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="sat")
    for step in (2, 4):
        _report(tmp_path, step)
    out = capsys.readouterr().out
    assert "iteration 4/20 | loss 6.1000 | lr 1.00e-04 | 1.32 s/it | ETA 0:00:21 | acc 0.2500" in out
    assert "elapsed time per iteration" not in out + caplog.text
    assert (tmp_path / CURVE_CSV).read_text().splitlines()[1:] == ["2,6.3,0.0001,1.32,0.0", "4,6.1,0.0001,1.32,0.0"]
    assert not (tmp_path / CURVE_PNG).exists()  # not redrawn at every step: see below
    _report(tmp_path, 20)  # the last step
    assert (tmp_path / CURVE_PNG).stat().st_size > 5_000
    with patches_removed("progress_line"):  # stock SAT: its long line, no ETA, no curve
        caplog.clear()
        _report(tmp_path / "stock", 2)
    assert "elapsed time per iteration (ms): 1320.0" in caplog.text and "ETA" not in caplog.text
    assert not (tmp_path / "stock").exists()


def test_the_png_is_redrawn_at_the_last_step_and_when_the_last_drawing_is_old(tmp_path, monkeypatch):
    """A drawing costs the logging rank a few tenths of a second that the other ranks wait for: while the run trains
    the PNG is redrawn only when its last drawing is ``REDRAW_SECONDS`` old (the CSV gets every step)."""
    from sat_patches.diagnostics import progress
    drawn = []
    monkeypatch.setattr(progress, "draw_loss_curve", lambda run_dir: drawn.append(
        len((tmp_path / CURVE_CSV).read_text().splitlines()) - 1))
    clock = iter([100.0, 130.0, 161.0, 170.0, 175.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    for step in (1, 2, 3, 4):
        progress.record_step(str(tmp_path), step, 1.0, 1e-4, 900.0)
    progress.record_step(str(tmp_path), 5, 1.0, 1e-4, 900.0, last=True)
    assert drawn == [3, 5]  # 61 s after the first record, and the last step


def report_on_a_model_parallel_rank(save, steps):
    """SAT's report on a rank of one model-parallel group of two, at each ``(iteration, losses)`` of ``steps`` with
    this rank's loss; the warnings each report gave."""
    import warnings
    import torch.distributed as dist
    from sat import mpu
    from sat.training.deepspeed_training import report_iteration_metrics
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(2)
    args = argparse.Namespace(fp16=False, deepspeed=True, wandb=False, gradient_accumulation_steps=1, batch_size=1,
                              model_parallel_size=2, save=save)
    said = []
    for iteration, losses in steps:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            report_iteration_metrics(None, None, 1e-4, losses[dist.get_rank()], 900.0, iteration, 4, args, {})
        said.append([str(w.message) for w in seen if "model-parallel ranks" in str(w.message)])
    # stock SAT runs no collective here: without this a rank could leave while its peer still connects the
    # model-parallel group's sockets (gloo's connect returns on one side first)
    dist.barrier()
    dist.destroy_process_group()
    return said


STEPS = [(3, (4.25, 4.25)), (4, (4.25, 3.5))]  # equal, then different


@pytest.mark.slow  # two training runs on two ranks; the fast tier keeps the progress line's own tests
@pytest.mark.multirank
def test_the_model_parallel_ranks_losses_are_compared_and_a_difference_is_said(tmp_path):
    """The ranks of a model-parallel group compute one loss; a difference (different batches or weights within the
    group) is warned about by the group's first rank, with each rank's loss, and kept in the curve."""
    from multirank import run_ranks
    results = run_ranks(report_on_a_model_parallel_rank, 2, args=(str(tmp_path), STEPS), timeout=120)
    assert all(r.ok for r in results), results[0].output[-3000:]
    assert (tmp_path / CURVE_CSV).read_text().splitlines()[1:] == ["3,4.25,0.0001,0.9,0.0", "4,4.25,0.0001,0.9,0.75"]
    [equal, different] = results[0].result
    assert equal == [] and len(different) == 1 and "(4.25, 3.5, in model-parallel rank order)" in different[0]
    assert results[1].result == [[], []]  # the group's first rank says it


@pytest.mark.slow
@pytest.mark.multirank
def test_stock_sat_compares_no_losses(tmp_path):
    from multirank import run_ranks
    stock = run_ranks(report_on_a_model_parallel_rank, 2, args=(str(tmp_path), STEPS), timeout=120,
                      patches=["progress_line"])
    assert [r.result for r in stock] == [[[], []]] * 2 and not (tmp_path / CURVE_CSV).exists()


# Logged on the loggers the third parties log them on, in an interpreter where sat_patches, SAT and SAT's
# LoRA module were imported as a user's script does (so bitsandbytes' and DeepSpeed's own logging set-up is in
# place), beside a message of ours on the same logger that must always show. The third parties log the real
# lines only on some machines (bitsandbytes tries its faster 4-bit CPU kernel only on CPUs with AVX512-BF16;
# DeepSpeed names its accelerator once per fresh interpreter), so the test logs them itself and holds on any CPU.
NOISE_CODE = """
import importlib, logging, sat_patches, sat, sat.model.finetune.lora2
from sat_patches.core import noise
for name, module in (("bitsandbytes.backends.cpu.ops", "bitsandbytes.backends.cpu.ops"),
                     ("DeepSpeed", "deepspeed.utils.logging")):
    assert importlib.import_module(module).logger.name == name  # the logger the third party logs on
for name, text in noise.QUIETED.items():
    logging.getLogger(name).warning(text + ": %s", "logged by the test")
    logging.getLogger(name).warning("KEPT " + name)
"""


@pytest.mark.slow  # a fork of a server holding SAT's third-party imports, per state (about 1 s each)
@pytest.mark.parametrize("disable", ["", "quiet_third_party"])
def test_third_party_import_noise_is_quiet_unless_disabled(disable):
    from sat_patches.core import noise
    from multirank import run_fresh
    out = run_fresh(NOISE_CODE, env={"SAT_PATCHES_DISABLE": disable})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert sorted(noise.QUIETED) == ["DeepSpeed", "bitsandbytes.backends.cpu.ops"]
    for name, message in noise.QUIETED.items():
        assert "KEPT " + name in text, text[-3000:]  # the logger's output is seen
        assert (message in text) == bool(disable), text[-3000:]


def test_pin_memory_warning_of_cpu_ranks_is_quiet_unless_disabled():
    import warnings
    import torch
    from sat_patches.core import noise
    from patching import patches_removed
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, pin_memory=True)
    for removed in (False, True):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            noise.remove(), noise.install()  # the quieting filter first again
            if removed:
                with patches_removed(noise.PATCH_NAME):
                    list(loader)
            else:
                list(loader)
        pinned = [w for w in seen if "pin_memory" in str(w.message)]
        assert bool(pinned) == (removed and not torch.cuda.is_available()), [str(w.message) for w in seen]
