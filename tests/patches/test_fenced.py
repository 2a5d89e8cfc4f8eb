"""A diagnostic that fails never ends a run: a plotting library that imports but is broken (no
``matplotlib.use``) made the loss-curve drawing raise inside SAT's ``report_iteration_metrics`` and both
ranks died at iteration 1. Now the curve says once that it is off and training finishes.

Also runnable as a script (what each rank runs): ``tests/patches/test_fenced.py <tiny_lora args>`` with a
``matplotlib`` module that has no ``use``."""
import os
import re
import sys

import pytest

HERE = os.path.abspath(__file__)


@pytest.mark.slow
@pytest.mark.multirank
def test_a_loss_curve_drawer_that_raises_does_not_stop_a_two_rank_run(tmp_path):
    from multirank import run_script
    results = run_script([HERE, "--train-iters", "4", "--log-interval", "1", "--save", str(tmp_path / "run")],
                         nranks=2, timeout=240)
    for r in results:
        assert r.ok, r.output[-4000:]
    out = results[0].output
    assert re.search(r"^iteration 4/4 \| loss [0-9.]+ \|", out, re.M), out[-3000:]
    assert out.count("the loss curve (loss_curve.csv/.png) failed and is off") == 1, out[-3000:]
    assert "AttributeError" in out and "use" in out  # its traceback, once
    [run_dir] = (tmp_path / "run").glob("tiny-lora-*")  # SAT's run directory under --save
    assert (run_dir / "loss_curve.csv").exists() and not (run_dir / "loss_curve.png").exists()


def test_a_failing_diagnostic_is_reported_once_and_turned_off(capsys):
    from sat_patches.core.fenced import Diagnostic
    calls = []

    def broken(x):
        calls.append(x)
        raise ZeroDivisionError("no")
    d = Diagnostic("thing")
    assert d.run(broken, 1, default="off") == "off" and d.run(broken, 2) is None
    assert calls == [1] and capsys.readouterr().err.count("the thing failed and is off") == 1


if __name__ == "__main__":
    import types
    sys.modules["matplotlib"] = types.ModuleType("matplotlib")  # imports, but has no use()
    from tiny_lora import main
    sys.exit(main(sys.argv[1:]))
