"""Start-up of a training rank with sat_patches, over stock SAT's: what ``import sat_patches`` adds to every process.

    python benchmarks/start_up.py            # 6 rounds
    python benchmarks/start_up.py --rounds 2

Each variant is a fresh interpreter importing what a rank of a SAT fine-tune imports (torch, SAT's training
loop, DeepSpeed, SAT's LoRA module); the patched one imports sat_patches first, as ``python -m sat_patches.launch``
does, so every patch goes on when SAT is imported. Stock and patched alternate (either first) so that both see the
same machine. Measured in the child: the time to import everything (``ready``); measured by this process: the
wall time until the child has exited (``total``: the interpreter's teardown included). A third kind of child
imports SAT's modules first and then sat_patches, which applies every patch at once: the time of that import is
what sat_patches itself costs a process (``apply``: our modules' import and the patches going on). The start-up
hook, which an installed sat_patches runs in every interpreter, defers libraries SAT imports and a fine-tune never
uses (``deferred_imports``): the stock child runs with it off, the other two with it on. Each child then imports
what ``deepspeed.initialize`` with ZeRO imports in every run, DeepSpeed's Muon kernels (``zero``); a fourth child,
patched but for ``deepspeed_muon_compile_on_first_call``, measures only that import (stock SAT has imported torch's
compiler already, with bitsandbytes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import json, sys, time
start = time.perf_counter()
if sys.argv[1] in ("patched", "muon-off"):
    import sat_patches
import torch, deepspeed, sat, sat.training.deepspeed_training, sat.model.finetune.lora2
ready = time.perf_counter() - start
apply = 0.0
if sys.argv[1] == "after":
    t = time.perf_counter()
    import sat_patches
    apply = time.perf_counter() - t
if sys.argv[1] != "stock":
    assert sat_patches.is_patched("get_args_cpu_device")
t = time.perf_counter()
import deepspeed.runtime.zero.muon.muon_optimizer  # what deepspeed.initialize with ZeRO imports, Muon or not
zero = time.perf_counter() - t
print(json.dumps({"ready": ready, "apply": apply, "zero": zero}), flush=True)
"""


def run(variant: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if variant == "muon-off":
        env["SAT_PATCHES_DISABLE"] = "deepspeed_muon_compile_on_first_call"
    if variant == "stock":  # SAT's own imports (the start-up hook still serves triton's stand-in: without triton,
        env["SAT_PATCHES_DISABLE"] = "deferred_imports"  # stock SAT cannot be imported on a CPU machine)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True, env=env, timeout=600)
    total = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), total=total)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    rows = []
    for round_ in range(a.rounds):
        order = ("stock", "patched", "after", "muon-off")
        order = order if round_ % 2 == 0 else order[::-1]
        got = {variant: run(variant) for variant in order}
        rows.append(got)
        print(f"round {round_ + 1}: stock ready {got['stock']['ready']:.2f} s, total {got['stock']['total']:.2f} s | "
              f"patched ready {got['patched']['ready']:.2f} s, total {got['patched']['total']:.2f} s | "
              f"ratio {got['patched']['total'] / got['stock']['total']:.3f} | import sat_patches after SAT "
              f"{got['after']['apply']:.2f} s | ZeRO's Muon import: patched {got['patched']['zero']:.2f} s, "
              f"without deepspeed_muon_compile_on_first_call {got['muon-off']['zero']:.2f} s", flush=True)
    ratio = statistics.median(r["patched"]["total"] / r["stock"]["total"] for r in rows)
    stock = statistics.median(r["stock"]["total"] for r in rows)
    apply = statistics.median(r["after"]["apply"] for r in rows)
    zero = {v: statistics.median(r[v]["zero"] for r in rows) for v in ("patched", "muon-off")}
    print(f"median: patched/stock total {ratio:.3f} (stock {stock:.2f} s); import sat_patches after SAT (our modules "
          f"and every patch applied) {apply:.2f} s; ZeRO's Muon import patched {zero['patched']:.2f} s, without "
          f"deepspeed_muon_compile_on_first_call {zero['muon-off']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
