"""Training-step time with sat_patches' diagnostics on, over the same run with them off.

    python benchmarks/step_overhead.py            # LLaMA-style LoRA model, hidden 1024, 4 layers, MP=2 on 2 ranks
    python benchmarks/step_overhead.py --small    # a few seconds, to try it out

The diagnostics are what sat_patches adds to every step and collective without changing the result: the
memory ledger (``ledger_*``), the hang watchdog around SAT's collective calls (``hang_watch_*``,
``collective_timeout``) and the rank heartbeat (``rank_heartbeat``). Both variants run SAT's own
``training_main`` (``tests/support/tiny_lora.py``) on 2 CPU ranks over gloo, in the same two processes,
in turns: a run with the diagnostics and one with them removed (``patching.patches_removed`` of tests/support),
either first, and so on, so that both see the same machine. The step time is the wall time of SAT's ``train_step`` on the
slower rank, median over a run's iterations after the first few; the overhead is the median over the
rounds of (on / off) - 1. Target: the diagnostics cost at most 2% of a step.

Stock SAT is not a variant: it cannot train on CPU ranks at all (its process group has no backend for
CPU tensors, and ``get_args`` refuses a CPU device); "off" is sat_patches with only the patches a CPU
run needs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))  # tests/support: the test kit (run_ranks, tiny models)

DIAGNOSTICS = ["rank_heartbeat", "collective_timeout", "ledger_build", "ledger_lora", "ledger_start", "ledger_load",
               "ledger_from_pretrained", "ledger_split_rank0", "ledger_split_receive", "ledger_deepspeed_init",
               "ledger_train_step", "hang_watch_parameter_sync", "hang_watch_train_step", "hang_watch_evaluate",
               "hang_watch_save_checkpoint", "hang_watch_broadcast_data", "hang_watch_training_main"]
FULL = ["--hidden-size", "1024", "--num-layers", "4", "--num-attention-heads", "16", "--train-iters", "60"]
SMALL = ["--hidden-size", "128", "--num-layers", "2", "--train-iters", "20"]
WARM_UP = 5
TARGET = 0.02


def step_times(extra: list, rounds: int, summary_dir: str) -> list:
    """(every rank) ``rounds`` pairs of ``tiny_lora`` runs, diagnostics on and off, alternating which
    goes first; per run, whether the diagnostics were on and the wall time of each ``train_step``."""
    import time
    import sat.training.deepspeed_training as dt
    from patching import patches_removed
    import tiny_lora
    runs = []

    def timed(inner):
        def train_step(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                runs[-1][1].append(time.perf_counter() - start)
        return train_step

    for round_ in range(rounds):
        for diagnostics in ((True, False) if round_ % 2 == 0 else (False, True)):  # either may go first
            runs.append((diagnostics, []))
            with contextlib.nullcontext() if diagnostics else patches_removed(*DIAGNOSTICS):
                inner = dt.train_step
                dt.train_step = timed(inner)
                try:
                    tiny_lora.main(["--model-parallel-size", "2", "--log-interval", "1000",
                                    "--summary-dir", summary_dir] + extra)
                finally:
                    dt.train_step = inner
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--rounds", type=int, default=5, help="pairs of runs (on, off)")
    parser.add_argument("--timeout", type=float, default=1800)
    opts = parser.parse_args(argv)
    from multirank import run_ranks

    with tempfile.TemporaryDirectory(prefix="satp-steps-") as summary_dir:
        results = run_ranks("step_overhead:step_times", 2, args=(SMALL if opts.small else FULL, opts.rounds, summary_dir),
                            timeout=opts.timeout)
    for r in results:
        if not r.ok:
            print(f"rank {r.rank} failed:\n{(r.exception or r.output)[-3000:]}")
            return 1
    medians = []
    for run in zip(*(r.result for r in results)):
        steps = [max(ts) for ts in zip(*(times for _, times in run))][WARM_UP:]  # a step ends on its slower rank
        medians.append((run[0][0], statistics.median(steps)))
    ratios = []
    for i in range(0, len(medians), 2):
        on, off = (dict(medians[i:i + 2])[flag] for flag in (True, False))
        ratios.append(on / off)
        print(f"round {i // 2 + 1}: median step with diagnostics {on * 1e3:8.2f} ms, without {off * 1e3:8.2f} ms, "
              f"ratio {on / off:.3f}")
    overhead = statistics.median(ratios) - 1
    print(f"\ndiagnostics overhead per step: {overhead * 100:+.1f}% (median of {len(ratios)} rounds; "
          f"target <= {TARGET * 100:.0f}%)")
    return 0 if overhead <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
