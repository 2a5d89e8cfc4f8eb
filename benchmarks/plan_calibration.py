"""The plan's terms against the bytes the code allocates at full size, counted on meta tensors.

    python benchmarks/plan_calibration.py

For each model and model-parallel size: the LM head (SAT's ColumnParallelLinear gathering the full
vocabulary) with the fine-tuning loss, forward and backward, at batch 1 and the demo's max_length, in bf16
(``sat_patches.testing.live_bytes``); beside it the plan's "logits and loss" term. Then one language layer
of the real CogVLM model (vision experts, LoRA, base frozen) on CPU at several widths and lengths against
the plan's per-layer working set at those sizes. Target: within 15%.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


LAYERS = [(256, 512, 4, 120, "bfloat16"), (256, 1024, 4, 120, "bfloat16"), (512, 512, 8, 240, "bfloat16"),
          (512, 1376, 8, 240, "bfloat16"), (256, 512, 4, 120, "float32")]


def layer_table() -> bool:
    import tempfile
    import torch
    from sat_patches.cogvlm import prepare_tiny_run
    from sat_patches.testing import run_ranks
    from sat_patches.tools import plan
    with tempfile.TemporaryDirectory(prefix="satp-calibration-") as tmp:
        tiny = prepare_tiny_run(tmp, "cogvlm", n_train=1, n_valid=1)
        shapes = [(h, f, heads, t, getattr(torch, d)) for h, f, heads, t, d in LAYERS]
        [r] = run_ranks("sat_patches.testing.live_bytes:one_layer_saved_bytes", 1, args=(tiny, shapes), timeout=600)
    if not r.ok:
        print((r.exception or r.output)[-3000:])
        return False
    print(f"\n{'language layer (hidden, ffn, heads, tokens, dtype)':<52}{'measured MB':>12}{'plan MB':>10}{'ratio':>8}")
    ok = True
    for (h, f, heads, t, d), measured in zip(LAYERS, r.result):
        planned = plan._layer_working_set(t, h, f, heads, 1, 2 if d == "bfloat16" else 4)
        ok &= abs(planned / measured - 1) <= 0.15
        print(f"{str((h, f, heads, t, d)):<52}{measured / 1e6:>12.3f}{planned / 1e6:>10.3f}{planned / measured:>8.3f}")
    return ok


def main() -> int:
    from sat_patches.testing.live_bytes import head_and_loss_peak
    from sat_patches.tools import plan
    print(f"{'model':<18}{'MP':>4}{'tokens':>8}{'measured GB':>13}{'plan GB':>10}{'plan / measured':>17}")
    ok = True
    for name in ("cogvlm-base-490", "cogagent-chat"):
        config = plan.resolve_model(name)
        tokens = plan.default_seq_len(config)
        for mp in (1, 2, 4):
            measured = head_and_loss_peak(mp, tokens, config["hidden_size"], config["vocab_size"])
            planned = plan.estimate(config, plan.Setup(mp=mp, micro_batch=1, seq_len=tokens)).device["logits and loss"]
            ok &= abs(planned / measured - 1) <= 0.15
            print(f"{name:<18}{mp:>4}{tokens:>8}{measured / 1e9:>13.3f}{planned / 1e9:>10.3f}{planned / measured:>17.3f}")
    ok &= layer_table()
    print("\nevery term within 15%" if ok else "\nA TERM IS OFF BY MORE THAN 15%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
