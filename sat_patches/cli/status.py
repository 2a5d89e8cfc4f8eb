"""``sat-patches status``: which patches are applied, skipped or disabled, and why; the order on shared targets."""
from __future__ import annotations

import contextlib
import json
import sys

import sat_patches

from ..core.registry import IN_ORDER


def cmd_status(args) -> int:
    with contextlib.redirect_stdout(sys.stderr):  # what modules print at import stays out of --json
        rows = sat_patches.status()
    print(json.dumps(rows, indent=2) if args.json else sat_patches.format_status(rows))
    return 0 if all(r["status"] in IN_ORDER for r in rows) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="which patches are applied, skipped or disabled, and why")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)
