"""SAT's own training_main trains a tiny LoRA LLaMA on 2 CPU ranks; stock SAT cannot."""
import json
import math
import re

import pytest

from multirank import run_script

pytestmark = pytest.mark.multirank
SCRIPT = ["-m", "tiny_lora"]


def _losses(tmp_path, nranks=2):
    return [json.loads((tmp_path / f"loss{r}.json").read_text()) for r in range(nranks)]


# whole training runs on two ranks: slow; the fast tier keeps stock SAT's failure on CPU ranks below
@pytest.mark.slow
@pytest.mark.parametrize("mp", [1, 2])
def test_training_main_two_ranks_loss_falls(tmp_path, mp):
    results = run_script([*SCRIPT, "--model-parallel-size", str(mp), "--loss-log", str(tmp_path / "loss{rank}.json")],
                         nranks=2, timeout=240)
    for r in results:
        assert r.ok, r.output[-4000:]
    losses = _losses(tmp_path)
    for per_rank in losses:
        assert len(per_rank) == 12 and all(math.isfinite(x) for x in per_rank)
        assert sum(per_rank[-3:]) / 3 < sum(per_rank[:3]) / 3 - 0.02, per_rank
    if mp == 2:  # both ranks of one model-parallel group see the same batch and gathered logits
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert re.search(r"^iteration 12/12 \| loss [0-9.]+ \|", results[0].output, re.M)


@pytest.mark.slow  # ranks that torchrun starts, each importing torch and SAT (over 10 s on 2 cores)
def test_stock_sat_cannot_train_on_cpu_ranks(tmp_path):
    # each rank on a node of its own: the first to fail does not end the other before it fails the same way
    results = run_script([*SCRIPT, "--model-parallel-size", "2"], nranks=2, timeout=240, patches="stock", nodes=2)
    for r in results:
        assert r.returncode not in (0, None) and not r.timed_out
        assert "LOCAL_RANK (default 0) and args.device inconsistent" in r.output
