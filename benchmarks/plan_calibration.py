"""The plan's terms against the bytes the code allocates at full size, counted on meta tensors.

    python benchmarks/plan_calibration.py

For each model and model-parallel size: the LM head (SAT's ColumnParallelLinear gathering the full
vocabulary) with the fine-tuning loss, forward and backward, at batch 1 and the demo's max_length, in bf16
(``sat_patches.testing.live_bytes``); beside it the plan's "logits and loss" term. Target: within 15%.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    print("\nevery term within 15%" if ok else "\nA TERM IS OFF BY MORE THAN 15%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
