"""``sat-patches evaluate CKPT DATA --local_tokenizer TOKENIZER [--mp N] [--out DIR]`` (also ``python -m
sat_patches evaluate``): every sample of DATA answered by the saved model, scored, written out
(:mod:`sat_patches.cogvlm.evaluation`). On several ranks::

    torchrun --nproc-per-node 4 -m sat_patches.launch -m sat_patches evaluate CKPT DATA --mp 2 ...
"""
from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sat-patches evaluate",
                                description="every sample of DATA answered by the checkpoint, scored, written out")
    p.add_argument("checkpoint", help="a SAT checkpoint directory (holds 'latest' and model_config.json)")
    p.add_argument("data", help="a .jsonl file or a folder of <label>.jpg images")
    p.add_argument("--local_tokenizer", required=True, help="the tokenizer's folder")
    p.add_argument("--mp", type=int, default=1, help="model-parallel size to load at (divides the ranks)")
    p.add_argument("--out", default="evaluation", help="folder for predictions.jsonl and summary.json")
    p.add_argument("--version", default="base", help="prompt template: base, chat, vqa, chat_old")
    p.add_argument("--max_length", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--import", dest="imports", action="append", default=[],
                   help="module that registers the checkpoint's model_class (e.g. a fork's utils.models); "
                        "its class is then used as it is, LoRA included when its constructor adds it")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from ..cogvlm import evaluation  # torch and SAT: only once an evaluation is asked for (the CLI starts without)
    try:
        evaluation.evaluate(a.checkpoint, a.data, a.local_tokenizer, a.mp, a.out, a.version, a.max_length,
                            a.max_new_tokens, a.imports)
    except evaluation.DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
