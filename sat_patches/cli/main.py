"""``sat-patches`` command line: ``status``, ``doctor``, ``plan``, ``report``, ``scripts``, ``export``, ``import``.

Each subcommand's module adds its parser (``add_parser``) and is listed in :data:`COMMANDS`. Importing
this module imports neither torch nor SAT: ``status`` (which applies the patches) and ``doctor``
(which looks at torch, CUDA and the patches) import them when they run.
"""
from __future__ import annotations

import argparse
import sys

from . import doctor, export, plan, report, scripts, status

# (name, function that adds the subparser)
COMMANDS = [("status", status.add_parser), ("doctor", doctor.add_parser), ("plan", plan.add_parser),
            ("report", report.add_parser), ("scripts", scripts.add_parser), ("export", export.add_parser)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sat-patches", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for _, add in COMMANDS:
        add(sub)
    return parser


# verbs with their own argument parser: everything after the verb is theirs (``sat-patches export --help``)
OWN_PARSER = {"export": export.main, "import": export.import_main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_PARSER:
        return OWN_PARSER[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # bad input: the message says what to change
        print(f"sat-patches {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
