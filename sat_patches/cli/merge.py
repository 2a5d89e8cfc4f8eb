"""``sat-patches merge CHECKPOINT OUTPUT`` (also ``python -m sat_patches merge``): a model-parallel LoRA checkpoint
as one MP=1 checkpoint with the LoRA folded in (:mod:`sat_patches.checkpoints.merge`)."""
from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sat-patches merge", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="SAT checkpoint directory (with 'latest' and model_config.json), or a CogVideoX "
                   "run's folder (with training_config.yaml)")
    p.add_argument("output", help="new directory for the MP=1 checkpoint")
    p.add_argument("--lora-alpha", type=float, default=None,
                   help="the LoraMixin lora_alpha used in training (default: a CogVideoX run's training_config.yaml "
                        "says it, else 1, SAT's and CogVLM's default)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to merge (default: 'latest')")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    p.add_argument("--import", dest="imports", action="append", default=[],
                   help="module that registers the checkpoint's model_class (e.g. utils.models)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from ..checkpoints import cogvideo, merge  # torch and SAT: only once asked for (the CLI starts without them)
    try:
        if cogvideo.is_video_run(a.checkpoint):  # a CogVideoX run: its DiT, from the checkpoint alone
            info = cogvideo.merge(a.checkpoint, a.output, a.lora_alpha, a.iteration, a.overwrite)
        else:
            alpha = 1.0 if a.lora_alpha is None else a.lora_alpha
            info = merge.merge(a.checkpoint, a.output, alpha, a.iteration, a.overwrite, a.imports)
    except merge.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, merge.MergeError) else 2  # the statuses of the exits these errors replace
    print(f"merged {info['shards']} model-parallel shard(s) of iteration {info['iteration']} and "
          f"{info['lora_layers']} LoRA layer(s) into {a.output} (MP=1)")
    return 0
