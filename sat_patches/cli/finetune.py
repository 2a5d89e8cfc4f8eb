"""``sat-patches finetune prepare|train|verify`` (also ``python -m sat_patches finetune``): standalone CogVLM /
CogAgent LoRA fine-tuning on SAT, no CogVLM checkout needed (:mod:`sat_patches.cogvlm.standalone`)::

    sat-patches finetune prepare --kind cogvlm --workdir RUN     # tiny model/tokenizer/data
    torchrun --nproc-per-node 2 -m sat_patches.launch -m sat_patches finetune train --kind cogvlm \\
        --from_pretrained RUN/model --local_tokenizer RUN/tokenizer --train-data RUN/data/train ...
    sat-patches merge CHECKPOINT RUN/merged                      # MP=N + LoRA -> MP=1
    sat-patches finetune verify --kind cogvlm --probe RUN/probe.pt --merged RUN/merged --local_tokenizer RUN/tokenizer

``train`` takes upstream's demo options and SAT's (``--probe FILE`` records the trained model's logits on
one validation batch); ``verify`` reloads the merged MP=1 model and compares its logits with them.
"""
from __future__ import annotations

import argparse
import sys

from ..core.kinds import NAMES


def train(argv) -> int:
    from ..cogvlm import standalone  # torch and SAT: only once a run is asked for (the CLI starts without them)
    return standalone.train(argv)


def verify(argv) -> int:
    p = argparse.ArgumentParser(prog="sat-patches finetune verify")
    p.add_argument("--kind", choices=NAMES, default="cogvlm")
    p.add_argument("--probe", required=True, help="the file train --probe wrote")
    p.add_argument("--merged", required=True, help="MP=1 checkpoint written by sat-patches merge")
    p.add_argument("--local_tokenizer", required=True)
    p.add_argument("--max_length", type=int, default=80)
    p.add_argument("--version", default="base")
    p.add_argument("--tolerance", type=float, default=1e-4)
    a = p.parse_args(argv)
    from ..cogvlm import standalone  # torch and SAT, as in train
    seen = standalone.compare_with_probe(a.kind, a.probe, a.merged, a.local_tokenizer, a.max_length, a.version)
    print(f"merged MP=1 model vs trained model: max |logit difference| = {seen['difference']:.2e} "
          f"(tolerance {a.tolerance:g})")
    note = "" if seen["answer"] else " (it ends the answer at once: a tiny model after a short run)"
    print(f"merged model output for '{seen['label']}': {seen['answer']!r}{note}", flush=True)
    if not seen["difference"] <= a.tolerance:
        print("error: the merged model's outputs differ from the trained model's", file=sys.stderr)
        return 1
    return 0


def prepare(argv) -> int:
    p = argparse.ArgumentParser(prog="sat-patches finetune prepare")
    p.add_argument("--kind", choices=NAMES, default="cogvlm")
    p.add_argument("--workdir", required=True)
    p.add_argument("--n-train", type=int, default=64)
    p.add_argument("--n-valid", type=int, default=8)
    p.add_argument("--task", choices=("captcha", "shapes"), default="captcha",
                   help="captcha: CAPTCHA images (upstream's demo data); shapes: coloured shapes, learnt in a minute")
    a = p.parse_args(argv)
    from ..cogvlm import prepare_tiny_run  # torch and SAT, as in train
    run = prepare_tiny_run(a.workdir, a.kind, n_train=a.n_train, n_valid=a.n_valid, task=a.task)
    print(f"prepared tiny {a.kind}: model {run.model_dir}, tokenizer {run.tokenizer_dir}, "
          f"data {run.train_dir} / {run.valid_dir}")
    return 0


COMMANDS = {"prepare": prepare, "train": train, "verify": verify}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: sat-patches finetune {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
