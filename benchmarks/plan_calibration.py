"""The plan's terms against the bytes the code allocates at full size, counted on meta tensors.

    python benchmarks/plan_calibration.py

1. For each model and model-parallel size: the LM head (SAT's ColumnParallelLinear gathering the full
   vocabulary) with the fine-tuning loss, forward and backward, at batch 1 and the demo's max_length, in
   bf16 (``benchmarks/calibration/live_bytes.py``); beside it the plan's "logits and loss" term.
2. One layer of each kind of the real CogVLM / CogAgent at full size (``benchmarks/calibration/layer_bytes.py``:
   the vision-expert language layer, with CogAgent's cross attention; the EVA2-CLIP-E layer; CogAgent's
   EVA2-CLIP-L encoder layer), with and without activation checkpointing, at MP 1, 2 and 4, training LoRA
   (and what upstream's demo trains), against the plan's step per layer.
   Also each language and EVA layer checkpointed selectively (``SAT_PATCHES_CHECKPOINT_SELECTIVE=1``).
3. A whole training step of each released model (every layer, checkpointing on; and with half the layers
   checkpointed selectively) against the sum of the plan's activation terms.
4. The meta measurement's cross-check: one language layer on real CPU tensors at small widths.
Target: within 15% per term; the whole step planned at or above the measured peak, by at most 30%.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))  # tests/support: the test kit (run_ranks, tiny models)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration"))  # layer_bytes, live_bytes


LAYERS = [(256, 512, 4, 120, "bfloat16"), (256, 1024, 4, 120, "bfloat16"), (512, 512, 8, 240, "bfloat16"),
          (512, 1376, 8, 240, "bfloat16"), (256, 512, 4, 120, "float32")]


def layer_table() -> bool:
    import tempfile
    import torch
    from sat_patches.cogvlm import prepare_tiny_run
    from multirank import run_ranks
    from sat_patches.planning import memory
    with tempfile.TemporaryDirectory(prefix="satp-calibration-") as tmp:
        tiny = prepare_tiny_run(tmp, "cogvlm", n_train=1, n_valid=1)
        shapes = [(h, f, heads, t, getattr(torch, d)) for h, f, heads, t, d in LAYERS]
        [r] = run_ranks("live_bytes:one_layer_saved_bytes", 1, args=(tiny, shapes), timeout=600)
    if not r.ok:
        print((r.exception or r.output)[-3000:])
        return False
    print(f"\n{'real CPU language layer (hidden, ffn, heads, tokens, dtype)':<60}{HEADER_MB}")
    ok = True
    for (h, f, heads, t, d), measured in zip(LAYERS, r.result):
        planned = memory.LANGUAGE_LAYER.bytes(t, h, f, heads, 1, 2 if d == "bfloat16" else 4)
        ok &= abs(planned / measured - 1) <= 0.15
        print(f"{str((h, f, heads, t, d)):<60}{measured / 1e6:>12.3f}{planned / 1e6:>10.3f}{planned / measured:>8.3f}")
    return ok


HEADER_MB = f"{'measured MB':>12}{'plan MB':>10}{'ratio':>8}"


def full_size_tables() -> bool:
    from sat_patches.cogvlm.shapes import upstream_config
    from sat_patches.core.kinds import KINDS
    from layer_bytes import (layer_bytes, planned_activations, planned_layer_bytes,
                                                 released_layers, step_peak)
    ok = True
    print(f"\n{'full-size layer (model, kind, train, MP, checkpointing)':<60}{HEADER_MB}")
    for name, kind in (("cogvlm-base-490", "cogvlm"), ("cogagent-chat", "cogagent")):
        config = upstream_config(name)
        kinds = ("language", "eva", "encoder") if kind == "cogagent" else ("language", "eva")
        for layer in kinds:
            for train in ("lora", "demo") if kind == "cogagent" else ("lora",):
                trains = KINDS[kind].demo_trains if train == "demo" else (lambda n: False)
                if layer == "encoder" and train == "lora":
                    continue  # frozen: keeps nothing per layer
                for mp in (1, 2, 4):
                    for checkpoint in (False, True):
                        measured = layer_bytes(config, layer, mp, checkpoint=checkpoint, trains=trains)
                        planned = planned_layer_bytes(config, layer, mp, checkpoint=checkpoint, train=train)
                        ok &= abs(planned / measured - 1) <= 0.15
                        label = f"{name}, {layer}, {train}, {mp}, {'on' if checkpoint else 'off'}"
                        print(f"{label:<60}{measured / 1e6:>12.2f}{planned / 1e6:>10.2f}{planned / measured:>8.3f}")
    print(f"\n{'full-size layer checkpointed selectively (model, kind, MP)':<60}{HEADER_MB}")
    for name in ("cogvlm-base-490", "cogagent-chat"):
        for layer in ("language", "eva"):
            for mp in (1, 2, 4):
                measured = layer_bytes(upstream_config(name), layer, mp, checkpoint=True, selective=1.0)
                planned = planned_layer_bytes(upstream_config(name), layer, mp, checkpoint=True, selective=1.0)
                ok &= abs(planned / measured - 1) <= 0.15
                print(f"{f'{name}, {layer}, {mp}':<60}{measured / 1e6:>12.2f}{planned / 1e6:>10.2f}"
                      f"{planned / measured:>8.3f}")
    print(f"\n{'whole step at MP=1, checkpointing on (model, train, selective share)':<60}"
          f"{HEADER_MB.replace('MB', 'GB')}")
    for name, kind in (("cogvlm-base-490", "cogvlm"), ("cogagent-chat", "cogagent")):
        config = upstream_config(name)
        layers = released_layers(config)
        for train, share in (("lora", 0.0), ("demo", 0.0), ("lora", 0.5)):
            trains = KINDS[kind].demo_trains if train == "demo" else (lambda n: False)
            measured = step_peak(config, 1, layers=layers, checkpoint=True, trains=trains, selective=share)
            planned = sum(planned_activations(config, 1, layers=layers, checkpoint=True, train=train,
                                              selective=share).values())
            ok &= measured <= planned <= 1.3 * measured
            print(f"{f'{name}, {train}, {share:g}':<60}{measured / 1e9:>12.3f}{planned / 1e9:>10.3f}"
                  f"{planned / measured:>8.3f}")
    return ok


def main() -> int:
    from live_bytes import head_and_loss_peak
    from sat_patches.planning import memory, shapes
    print(f"{'model':<18}{'MP':>4}{'tokens':>8}{'measured GB':>13}{'plan GB':>10}{'plan / measured':>17}")
    ok = True
    for name in ("cogvlm-base-490", "cogagent-chat"):
        config = shapes.resolve_model(name)
        tokens = shapes.default_seq_len(config)
        for mp in (1, 2, 4):
            measured = head_and_loss_peak(mp, tokens, config["hidden_size"], config["vocab_size"])
            planned = memory.estimate(config, memory.Setup(mp=mp, micro_batch=1, seq_len=tokens)).device["logits and loss"]
            ok &= abs(planned / measured - 1) <= 0.15
            ratio = planned / measured
            print(f"{name:<18}{mp:>4}{tokens:>8}{measured / 1e9:>13.3f}{planned / 1e9:>10.3f}{ratio:>17.3f}")
    ok &= full_size_tables()
    ok &= layer_table()
    print("\nevery term within its target" if ok else "\nA TERM MISSES ITS TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
