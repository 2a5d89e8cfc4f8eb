"""SAT's argument dump, interval timer line and CPU memory line go to the run directory's files."""
import argparse
import logging
import os

import pytest

from sat_patches.diagnostics import console
from patching import patches_removed


@pytest.fixture
def sat_log():
    """Everything SAT's logger prints, and the console module's run state reset afterwards."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    handler = Keep()
    logging.getLogger("sat").addHandler(handler)
    yield lines
    logging.getLogger("sat").removeHandler(handler)
    console.CurrentRun.directory = console.CurrentRun.iteration = None


def _args(tmp_path):
    return argparse.Namespace(save=str(tmp_path), iteration=0, lr=1e-4, save_args=False, experiment_name="x")


def test_arguments_go_to_the_run_directory_with_one_line(tmp_path, sat_log, capsys):
    from sat.training import deepspeed_training
    deepspeed_training.print_args(_args(tmp_path))
    with open(tmp_path / console.ARGUMENTS_TXT) as f:
        assert f.read().splitlines() == ["save = %r" % str(tmp_path), "iteration = 0", "lr = 0.0001",
                                         "save_args = False", "experiment_name = 'x'"]
    assert not any(".........." in l for l in sat_log)
    assert capsys.readouterr().out == f"arguments: 5 settings in {tmp_path / console.ARGUMENTS_TXT}\n"
    with patches_removed("sat_console_to_files"):
        deepspeed_training.print_args(_args(tmp_path / "stock"))
    assert any("  lr ......." in l for l in sat_log) and not (tmp_path / "stock").exists()


def test_interval_timers_go_to_step_times_csv(tmp_path, sat_log):
    from sat.training.utils import Timers
    timers = Timers()
    console.note_iteration(_args(tmp_path), 4)
    for name in ("forward", "backward"):
        timers(name).start(), timers(name).stop()
    timers.log(["forward", "backward", "allreduce"], normalizer=2)
    with open(tmp_path / console.STEP_TIMES_CSV) as f:
        header, row = f.read().splitlines()
    assert header == "iteration,forward_ms,backward_ms" and row.startswith("4,")
    assert not any("time (ms)" in l for l in sat_log)
    with patches_removed("timers_to_step_times"):
        timers.log(["forward"])
    assert any("time (ms) | forward: " in l for l in sat_log)  # ("[RANK 0] " first where a group exists)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU-only case")
def test_memory_line_only_where_cuda_is(sat_log):
    from sat.training import deepspeed_training
    deepspeed_training.report_memory("after 2 iterations")
    assert not sat_log
    with patches_removed("memory_report_cuda_only"):
        deepspeed_training.report_memory("after 2 iterations")
    [line] = sat_log
    assert line.endswith("after 2 iterations memory (MB) | allocated: 0.0 | max allocated: 0.0 | cached: 0.0 | "
                         "max cached: 0.0")

