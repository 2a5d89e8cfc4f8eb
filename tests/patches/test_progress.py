"""One short line per logged step with an ETA, and the loss curve beside the memory ledger."""
import argparse
import logging

import pytest

from sat_patches.diagnostics.progress import CURVE_CSV, CURVE_PNG, progress_line
from sat_patches.testing import patches_removed


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
    assert (tmp_path / CURVE_CSV).read_text().splitlines()[1:] == ["2,6.3,0.0001,1.32", "4,6.1,0.0001,1.32"]
    assert (tmp_path / CURVE_PNG).stat().st_size > 5_000
    with patches_removed("progress_line"):  # stock SAT: its long line, no ETA, no curve
        caplog.clear()
        _report(tmp_path / "stock", 2)
    assert "elapsed time per iteration (ms): 1320.0" in caplog.text and "ETA" not in caplog.text
    assert not (tmp_path / "stock").exists()


@pytest.mark.slow
def test_third_party_import_noise_is_quiet_unless_disabled():
    import os
    import subprocess
    import sys
    import sat_patches
    source = os.path.dirname(os.path.dirname(os.path.abspath(sat_patches.__file__)))
    code = "import sat_patches, sat, sat.model.finetune.lora2"
    noise = ("Failed to load CPU gemm_4bit_forward", "Setting accelerator to CPU")
    for disable, expected in (("", False), ("quiet_third_party", True)):
        env = dict(os.environ, PYTHONPATH=source, SAT_PATCHES_DISABLE=disable)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert [n in out.stdout + out.stderr for n in noise] == [expected, expected], out.stdout + out.stderr


def test_pin_memory_warning_of_cpu_ranks_is_quiet_unless_disabled():
    import warnings
    import torch
    from sat_patches.core import noise
    from sat_patches.testing import patches_removed
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
