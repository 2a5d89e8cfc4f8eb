"""Time and host memory of LoRA injection and merge, stock SAT vs sat_patches, in one run.

    python benchmarks/lora_inject.py              # LLaMA-7B widths (hidden 4096, ffn 11008), 4 layers, bf16, r=50
    python benchmarks/lora_inject.py --small      # a few MB, to try it out

Each variant runs in a fresh process (stock: ``SAT_PATCHES_DISABLE`` = every patch but the CPU
stand-ins, as ``multirank.stock_disable`` (tests/support); patched: every patch). A process builds the
base LLaMA model in bf16 (SAT ``LLaMAModel``, values written so every page is resident), warms the
code path on a 1-layer model, then measures:

* inject: ``model.add_mixin('lora', LoraMixin(layers, r, lora_alpha=2r), reinit=True)``;
* merge: ``model.get_mixin('lora').merge_lora()`` after B is made non-zero.

Memory is the peak RSS above the RSS just before the step (``/proc/self/clear_refs`` resets the
peak; ``VmHWM`` reads it), so it counts every temporary that touched memory. Targets for
sat_patches: inject peak extra <= 1.1x the LoRA parameter bytes, and >= 10x faster than stock.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

from _memory import proc_status_bytes

FULL = dict(num_layers=4, hidden_size=4096, num_attention_heads=32, inner_hidden_size=11008, vocab_size=32000)
SMALL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, inner_hidden_size=512, vocab_size=1024)
MiB = 2 ** 20


def _settle() -> int:
    """Free what can be freed, reset the peak RSS to now; returns the RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_bytes("VmRSS")


def _measure(step) -> dict:
    before = _settle()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_extra": proc_status_bytes("VmHWM") - before, "after_extra": proc_status_bytes("VmRSS") - before}


def build(cfg: dict):
    import torch
    from sat.model.official.llama_model import LLaMAModel
    args = LLaMAModel.get_args(**cfg, max_sequence_length=64, use_bias=False, skip_init=True, bf16=True)
    model = LLaMAModel(args, params_dtype=torch.bfloat16).bfloat16()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)  # resident pages, as loaded weights are
    return model


def child(cfg: dict, rank: int) -> dict:
    """(one process) Build, warm up, then measure injection and merge."""
    import torch
    import sat_patches  # noqa: F401  (applies the patches SAT_PATCHES_DISABLE leaves on)
    from sat.model.finetune.lora2 import LoraMixin

    def inject(model):
        n = len(model.transformer.layers)
        model.add_mixin("lora", LoraMixin(n, rank, lora_alpha=2 * rank), reinit=True)

    inject(build(dict(SMALL, num_layers=1)))  # warm-up: first-call imports and allocations
    model = build(cfg)
    result = {"inject": _measure(lambda: inject(model))}
    lora = {n: p for n, p in model.named_parameters() if "matrix_" in n}
    result["lora_bytes"] = sum(p.numel() * p.element_size() for p in lora.values())
    result["lora_devices"] = sorted({p.device.type for p in lora.values()})
    with torch.no_grad():
        for name, p in lora.items():
            if "matrix_B" in name:
                p.normal_(0, 0.01)
    result["merge"] = _measure(lambda: model.get_mixin("lora").merge_lora())
    return result


def run_variant(variant: str, cfg: dict, rank: int) -> dict:
    from multirank import stock_disable
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), WANDB_MODE="disabled",
               SAT_PATCHES_DISABLE=",".join(stock_disable()) if variant == "stock" else "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg), "--rank", str(rank)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{out.stderr[-4000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def report(cfg: dict, rank: int, stock: dict, patched: dict) -> str:
    lora_mib = patched["lora_bytes"] / MiB
    rows = [f"LoRA injection/merge, LLaMA widths hidden {cfg['hidden_size']} ffn {cfg['inner_hidden_size']}, "
            f"{cfg['num_layers']} layers, bf16, r={rank}; LoRA params {lora_mib:.2f} MiB "
            f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')})",
            f"{'step':8} {'variant':8} {'time s':>9} {'peak extra MiB':>15} {'x LoRA bytes':>13} {'kept MiB':>9}"]
    for step in ("inject", "merge"):
        for name, res in (("stock", stock), ("patched", patched)):
            r = res[step]
            rows.append(f"{step:8} {name:8} {r['seconds']:9.4f} {r['peak_extra'] / MiB:15.2f} "
                        f"{r['peak_extra'] / res['lora_bytes']:13.2f} {r['after_extra'] / MiB:9.2f}")
        s, p = stock[step], patched[step]
        rows.append(f"{step:8} {'ratio':8} stock/patched time {s['seconds'] / p['seconds']:.1f}x, "
                    f"peak extra {s['peak_extra'] / max(p['peak_extra'], 1):.1f}x")
    inj = patched["inject"]
    ok_mem = inj["peak_extra"] <= 1.1 * patched["lora_bytes"]
    ok_time = stock["inject"]["seconds"] >= 10 * inj["seconds"]
    rows.append(f"targets: patched inject peak extra <= 1.1x LoRA bytes: {'met' if ok_mem else 'MISSED'} "
                f"({inj['peak_extra'] / patched['lora_bytes']:.2f}x); >= 10x faster than stock: "
                f"{'met' if ok_time else 'MISSED'} ({stock['inject']['seconds'] / inj['seconds']:.1f}x)")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny widths, to try it out")
    parser.add_argument("--layers", type=int, default=None, help="number of transformer layers")
    parser.add_argument("--rank", type=int, default=50, help="LoRA rank (CogAgent's demo uses 50)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(json.loads(args.child), args.rank)), flush=True)
        return 0
    cfg = dict(SMALL if args.small else FULL)
    if args.layers:
        cfg["num_layers"] = args.layers
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [root, os.path.join(root, "tests", "support")]  # tests/support: the test kit (run_ranks, tiny models)
    stock = run_variant("stock", cfg, args.rank)
    patched = run_variant("patched", cfg, args.rank)
    print(report(cfg, args.rank, stock, patched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
