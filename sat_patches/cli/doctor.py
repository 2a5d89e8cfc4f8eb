"""``sat-patches doctor``: one screen on whether this machine can run a multi-GPU SAT fine-tuning job; every
problem says what to do, and the exit status is 1 when any check fails (blocking). It runs on a CPU-only machine too.

The facts are gathered by :mod:`.doctor_facts` and checked by :mod:`.doctor_checks`; this module prints them.
"""
from __future__ import annotations

import contextlib
import json
import platform
import sys
from dataclasses import asdict
from typing import List

from ..core import settings
from .doctor_checks import FAIL, WARN, Check, run
from .doctor_facts import Facts, gather, plan_host_need


def format_checks(checks: List[Check], facts: Facts) -> str:
    v = facts.versions
    lines = [f"sat-patches doctor (sat_patches {v.get('sat_patches') or '?'}, python {v.get('python')}, "
             f"{platform.system().lower()})"]
    for c in checks:
        lines.append(f" {c.status:<5} {c.name:<15} {c.summary}")
        if c.fix and c.status in (FAIL, WARN):
            lines.append(f" {'':<5} {'':<15} -> {c.fix}")
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    lines.append(f"{fails} blocking problem(s), {warns} warning(s)." if fails or warns else "no problems found.")
    lines.append("")
    lines.append(format_settings(settings.table(facts.env)))
    return "\n".join(lines)


def format_settings(rows: List[dict]) -> str:
    """The declared ``SAT_PATCHES_*`` settings: name, value in force (or default), meaning."""
    width = max(len(r["name"]) for r in rows)
    lines = ["settings (environment variables; value set, or the default in brackets):"]
    for r in rows:
        value = r["value"] or f"[{r['default']}]"
        lines.append(f"  {r['name']:<{width}}  {value:<10} {r['meaning']}")
    return "\n".join(lines)


def cmd_doctor(args) -> int:
    with contextlib.redirect_stdout(sys.stderr):  # what modules print at import stays out of --json
        facts = gather(args.hostfile)
    if args.model:
        plan_host_need(facts, args.model, args.gpus, args.gpu_mem)
    checks = run(facts)
    blocking = sum(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "versions": facts.versions,
                          "settings": settings.table(facts.env), "blocking": blocking}, indent=1))
    else:
        print(format_checks(checks, facts))
    return 1 if blocking else 0


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine for a multi-GPU SAT fine-tuning run (exit 1 when blocked)")
    p.add_argument("--model", default=None, help="check host RAM against this model's plan (see `plan --model`)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node of the planned run (default: visible)")
    p.add_argument("--gpu-mem", type=float, default=None, help="GB per GPU of the planned run (default: visible)")
    p.add_argument("--hostfile", default="hostfile", help="DeepSpeed hostfile to check (default ./hostfile)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
