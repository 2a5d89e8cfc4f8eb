"""Host time and operations dispatched per language layer of a LoRA training step, ours beside the peer's.

    python benchmarks/layer_host_time.py                  # tiny widths, 32 and 16 language layers, on the CPU
    python benchmarks/layer_host_time.py --hf-code DIR    # the peer's code from DIR

Both stacks as the GPU kit's peer part builds them (``benchmarks/gpu/proof_peer.py``): SAT + sat_patches with
SAT's ``LoraMixin``, and the HF CogVLM code with PEFT's LoRA on the same layers (by default the test kit's stand-in
of the released code, ``tests/support/cogvlm_hf_standin``: the released code is not ours to ship), bf16, the same
micro-batch, every layer checkpointed. A step here is forward, loss and backward (no optimizer). Per layer: the
difference between the steps at 32 and at 16 language layers, over 16, so that the embedding, EVA, the head and the
loss cancel. Time: the fastest of ``--steps`` steps after a warm-up, the stacks in turns; operations: aten operations dispatched
(``TorchDispatchMode``) in one step, recomputation included. At tiny widths much of the time is the host's (Python
and dispatch per layer); the CPU's bf16 products and attention kernels take the rest. This is the CPU path
of each stack: SAT's rotary embedding runs sat_patches' torch kernel here (with triton on CUDA, SAT's own kernel, which
dispatches no aten operation), and attention is ``scaled_dot_product_attention`` on the CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(HERE, "gpu"), ROOT, os.path.join(HERE, "calibration"), os.path.join(ROOT, "tests", "support")]
STANDIN = os.path.join(ROOT, "tests", "support", "cogvlm_hf_standin")
DEPTHS = (32, 16)


def operations(step) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.count


def measure(steps_of: dict, steps: int) -> dict:
    """``{stack: (fastest of `steps` steps after a warm-up, operations of one step)}``; the stacks' steps taken in
    turns, and the fastest kept, so that other work on the machine weighs on neither."""
    for step in steps_of.values():
        step()
    seconds = {stack: [] for stack in steps_of}
    for _ in range(steps):
        for stack, step in steps_of.items():
            start = time.perf_counter()
            step()
            seconds[stack].append(time.perf_counter() - start)
    return {stack: (min(seconds[stack]), operations(step)) for stack, step in steps_of.items()}


def stacks(config: dict, hf_code: str, micro_batch: int, tokens: int):
    """``{stack: step}`` for ours and the peer's at ``config``'s depth."""
    import torch
    import proof_peer
    import proof_steps as steps
    dev = torch.device("cpu")
    inputs = steps.batch_inputs(config, tokens, micro_batch, dev)
    ours, _ = steps.build_model(config, dev)
    steps.add_lora(ours)
    steps.checkpointing(ours, True)
    ours.train()
    peer, _ = proof_peer.hf_model(hf_code, config, dev)
    peer.train()
    peer_inputs = proof_peer.hf_inputs(inputs)

    def ours_step():
        ours(**inputs)[0].float().square().mean().backward()

    def peer_step():
        with proof_peer.checkpoint_each_layer(peer):
            peer(**peer_inputs).logits.float().square().mean().backward()

    return {"SAT + sat_patches": ours_step, "HF + PEFT": peer_step}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-code", default=STANDIN, help="folder with the HF CogVLM code (default: the stand-in)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the host's time, least disturbed)")
    parser.add_argument("--micro-batch", type=int, default=2)
    opts = parser.parse_args(argv)
    os.environ.setdefault("SAT_PATCHES_DEVICE", "cpu")
    import sat_patches  # noqa: F401  (before SAT)
    import torch
    from sat_patches.cogvlm.config import tiny_config
    from sat_patches.planning.shapes import default_seq_len, plan_config
    torch.manual_seed(0)
    torch.set_num_threads(opts.threads)
    figures = {}
    for depth in DEPTHS:
        config = dict(tiny_config("cogvlm"), num_layers=depth)
        tokens = default_seq_len(plan_config(config))
        for stack, figure in measure(stacks(config, opts.hf_code, opts.micro_batch, tokens), opts.steps).items():
            figures[stack, depth] = figure
            print(f"{stack}, {depth} layers: step {figures[stack, depth][0] * 1e3:.1f} ms, "
                  f"{figures[stack, depth][1]:,} operations", flush=True)
    print(f"\nper language layer (forward + backward, checkpointed; {tokens} tokens, micro-batch {opts.micro_batch}, "
          f"tiny widths, {torch.get_num_threads()} threads):")
    print("| stack | host time per layer | operations per layer |\n|---|---|---|")
    deep, shallow = DEPTHS
    for stack in ("HF + PEFT", "SAT + sat_patches"):
        seconds = (figures[stack, deep][0] - figures[stack, shallow][0]) / (deep - shallow)
        ops = (figures[stack, deep][1] - figures[stack, shallow][1]) / (deep - shallow)
        print(f"| {stack} | {seconds * 1e3:.2f} ms | {ops:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
