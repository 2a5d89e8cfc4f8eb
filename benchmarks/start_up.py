"""Start-up of a training rank with sat_patches, over stock SAT's: what ``import sat_patches`` adds to every process.

    python benchmarks/start_up.py            # 6 rounds
    python benchmarks/start_up.py --rounds 2

Each variant is a fresh interpreter importing what a rank of a SAT fine-tune imports (torch, SAT's training
loop, DeepSpeed, SAT's LoRA module); the patched one imports sat_patches first, as ``python -m sat_patches.launch``
does, so every patch goes on when SAT is imported. Stock and patched alternate (either first) so that both see the
same machine. Measured in the child: the time to import everything (``ready``); measured by this process: the
wall time until the child has exited (``total``). A third kind of child imports SAT's modules first and then
sat_patches, which applies every patch at once: the time of that import is what sat_patches itself costs a process
(``apply``: our modules' import and the patches going on). Stock SAT imports triton in its rotary module: without
triton, the stock and "after" children load our rotary kernel under SAT's name by path (as a machine with triton has
the module), importing nothing of sat_patches.
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
import importlib.util, json, os, sys, time
start = time.perf_counter()
if sys.argv[1] == "patched":
    import sat_patches
elif importlib.util.find_spec("triton") is None:
    name = "sat.model.position_embedding.triton_rotary"
    spec = importlib.util.spec_from_file_location(name, os.path.join(sys.argv[2], "sat_patches", "kernels", "rotary.py"))
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
import torch, deepspeed, sat, sat.training.deepspeed_training, sat.model.finetune.lora2
ready = time.perf_counter() - start
apply = 0.0
if sys.argv[1] == "after":
    t = time.perf_counter()
    import sat_patches
    apply = time.perf_counter() - t
if sys.argv[1] != "stock":
    assert sat_patches.is_patched("get_args_cpu_device")
print(json.dumps({"ready": ready, "apply": apply}), flush=True)
"""


def run(variant: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, variant, ROOT], capture_output=True, text=True, env=env,
                         timeout=600)
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
        order = ("stock", "patched", "after")
        order = order if round_ % 2 == 0 else order[::-1]
        got = {variant: run(variant) for variant in order}
        rows.append(got)
        print(f"round {round_ + 1}: stock ready {got['stock']['ready']:.2f} s, total {got['stock']['total']:.2f} s | "
              f"patched ready {got['patched']['ready']:.2f} s, total {got['patched']['total']:.2f} s | "
              f"ratio {got['patched']['total'] / got['stock']['total']:.3f} | import sat_patches after SAT "
              f"{got['after']['apply']:.2f} s", flush=True)
    ratio = statistics.median(r["patched"]["total"] / r["stock"]["total"] for r in rows)
    stock = statistics.median(r["stock"]["total"] for r in rows)
    apply = statistics.median(r["after"]["apply"] for r in rows)
    print(f"median: patched/stock total {ratio:.3f} (stock {stock:.2f} s); import sat_patches after SAT (our modules "
          f"and every patch applied) {apply:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
