"""``sat-patches`` command line: ``status``, ``doctor``, ``plan``, ``report``, ``scripts``.

Each subcommand's module adds its parser (``add_parser``) and is listed in :data:`COMMANDS`. Importing
this module imports neither torch nor SAT: ``status`` (which applies the patches) and ``doctor``
(which looks at torch, CUDA and the patches) import them when they run.
"""
from __future__ import annotations

import argparse
import json
import sys


def cmd_status(args) -> int:
    import sat_patches
    with imports_print_to_stderr():
        rows = sat_patches.status()
    print(json.dumps(rows, indent=2) if args.json else sat_patches.format_status(rows))
    return 0 if all(r["status"] in ("applied", "not needed", "disabled") for r in rows) else 1


def _status_parser(sub):
    p = sub.add_parser("status", help="which patches are applied, skipped or disabled, and why")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)


from . import doctor, plan, report, scripts  # noqa: E402
from .output import imports_print_to_stderr  # noqa: E402

# (name, function that adds the subparser)
COMMANDS = [("status", _status_parser), ("doctor", doctor.add_parser), ("plan", plan.add_parser),
            ("report", report.add_parser), ("scripts", scripts.add_parser)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sat-patches", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for _, add in COMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # bad input: the message says what to change
        print(f"sat-patches {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
