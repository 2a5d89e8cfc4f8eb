"""``sat-patches`` command line. Each subcommand's module adds its parser (``add_parser``); importing this
module imports neither torch nor SAT (the subcommands import them when they run).
"""
from __future__ import annotations

import argparse
import sys

from . import doctor, evaluate, export, finetune, merge, plan, report, scripts, status

COMMANDS = (status, doctor, plan, report, scripts)  # each adds its subparser
# verbs with their own argument parser: everything after the verb is theirs (``sat-patches export --help``)
OWN_PARSER = {
    "merge": (merge.main, "a model-parallel LoRA checkpoint (or a CogVideoX run) as one MP=1 checkpoint, LoRA "
                          "folded in"),
    "evaluate": (evaluate.main, "every sample of a data set answered by a checkpoint, scored, written out"),
    "finetune": (finetune.main, "standalone CogVLM / CogAgent LoRA fine-tuning: prepare, train, verify"),
    "export": (export.main, "a SAT checkpoint as a Hugging Face folder (hf) or a PEFT adapter (peft); a CogVideoX "
                            "run's LoRA for diffusers (diffusers)"),
    "import": (export.import_main, "a Hugging Face folder of CogVLM / CogAgent as a SAT checkpoint (hf)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sat-patches", description="multi-GPU CogVLM / CogAgent fine-tuning on SAT: "
                                     "check, plan, write the scripts, train, merge, evaluate, export")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for name, (_, text) in OWN_PARSER.items():
        sub.add_parser(name, help=text)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_PARSER:
        return OWN_PARSER[argv[0]][0](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # bad input: the message says what to change
        print(f"sat-patches {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
