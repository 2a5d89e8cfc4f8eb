"""A CogVLM training step with sat_patches' routing over the same step routed as CogVLM's own code routes it.

    python benchmarks/expert_routing.py                 # CPU, a CogVLM-shaped model (hidden 512, 4 layers, 256 patches)
    python benchmarks/expert_routing.py --small         # a few seconds, to try it out
    python benchmarks/expert_routing.py --device cuda --dtype bfloat16 --hidden 4096 --ffn 11008 --heads 32 \\
        --layers 8 --image-size 490 --max-length 1288 --batch 8      # on a GPU: CogVLM-17B's layer, fewer layers

Two variants of one model, same weights and batch (copied afresh for every step, as a new batch arrives), in turns (either first), activation checkpointing on:

* ``stock``: CogVLM's own routing (``utils/models/mixin.py``: boolean masks ``x[mask]``, ``out[mask] = ...`` in
  every layer, :func:`tests/support/fast_paths.boolean_mask_routing`) and SAT's own ``attention_fn_default``
  (the mask compared whole in every layer): the code a CogVLM fork runs without sat_patches' speed patches;
* ``sat_patches``: the routing read once per step (:mod:`sat_patches.cogvlm.routing`) and the attention mask's
  kind read once (``attention_mask_read_once``).

Prints per variant the median step time (forward, loss, backward) over the rounds, the host reads of one step
(tensor reads into Python and boolean-index counts: each waits for the device on a GPU), the ratio, and the
largest difference of the logits and gradients between the two (they must agree), and both relative to their size
beside the same variant run twice (in bf16 on a GPU neither is bitwise repeatable).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))  # tests/support: the test kit (run_ranks, tiny models)

import sat_patches  # noqa: E402  (first: makes ``import sat`` work without triton)
import torch  # noqa: E402

from patching import patches_removed  # noqa: E402
from fast_paths import (boolean_mask_routing, build_cogvlm, cogvlm_batch, host_reads,  # noqa: E402
                                            train_step)

FULL = dict(hidden=512, ffn=1376, heads=8, layers=4, image_size=224, max_length=300, batch=2, rounds=5)
SMALL = dict(hidden=128, ffn=256, heads=4, layers=2, image_size=56, max_length=80, batch=2, rounds=3)


def options(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes, a few seconds")
    for name in ("hidden", "ffn", "heads", "layers", "image_size", "max_length", "batch", "rounds"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args(argv)
    for name, value in (SMALL if a.small else FULL).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    return a


def timed(fn, device) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def largest_difference(a, b) -> float:
    (la, ga), (lb, gb) = a, b
    return max([float((la.float() - lb.float()).abs().max())] +
               [float((ga[n].float() - gb[n].float()).abs().max()) for n in ga])


def relative_differences(a, b) -> tuple:
    """(the logits' largest difference over their largest magnitude, the same for the gradient that differs most
    for its size): in bf16 two groupings of the same sums round apart, and a GPU's backward is not bitwise
    repeatable either; these are read beside the same variant run twice."""
    (la, ga), (lb, gb) = a, b

    def relative(x, y):
        return float((x.float() - y.float()).abs().max()) / max(float(y.float().abs().max()), 1e-30)
    return relative(la, lb), max(relative(ga[n], gb[n]) for n in ga)


def main(argv=None) -> int:
    a = options(argv)
    dtype = getattr(torch, a.dtype)
    eva = {"image_size": [a.image_size, a.image_size], "patch_size": 14}
    from sat_patches.cogvlm.config import tiny_config
    eva_args = {**tiny_config("cogvlm")["eva_args"], **eva}
    image_length = (a.image_size // 14) ** 2
    model, args = build_cogvlm(True, device=a.device, dtype=dtype, hidden_size=a.hidden, inner_hidden_size=a.ffn,
                               num_attention_heads=a.heads, num_layers=a.layers, max_length=a.max_length,
                               image_length=image_length, eva_args=eva_args)
    batch = cogvlm_batch(args, a.batch, device=a.device, dtype=dtype)
    variants = {"stock": lambda: (boolean_mask_routing(), patches_removed("attention_mask_read_once")),
                "sat_patches": lambda: ()}

    def run(name):
        with contextlib.ExitStack() as stack:
            for manager in variants[name]():
                stack.enter_context(manager)
            return train_step(model, {k: None if v is None else v.clone() for k, v in batch.items()})

    results = {name: run(name) for name in variants}  # (also the warm-up)
    reads = {name: host_reads(lambda n=name: run(n)) for name in variants}
    times = {name: [] for name in variants}
    for r in range(a.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            times[name].append(timed(lambda n=name: run(n), a.device))
    print(f"CogVLM step, {a.device} {a.dtype}: hidden {a.hidden}, ffn {a.ffn}, {a.layers} layers, {image_length} image "
          f"tokens of {a.max_length}, micro-batch {a.batch}, every layer checkpointed; median of {a.rounds} rounds")
    print(f"{'variant':<12} {'step s':>8} {'host reads':>11}")
    for name in variants:
        print(f"{name:<12} {statistics.median(times[name]):>8.3f} {reads[name]:>11}")
    ratio = statistics.median(times["stock"]) / statistics.median(times["sat_patches"])
    print(f"sat_patches is {ratio:.2f}x stock; largest difference of logits and gradients "
          f"{largest_difference(results['stock'], results['sat_patches']):.2e}")
    pairs = {"stock vs sat_patches": (results["stock"], results["sat_patches"]),
             "sat_patches run again": (run("sat_patches"), results["sat_patches"])}
    for label, (x, y) in pairs.items():
        logits, grads = relative_differences(x, y)
        print(f"{label}: logits {logits:.2e} of their largest, gradients {grads:.2e} of theirs (the most apart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
