"""The steps of a finetune script's run, each a child process printed (``+ ...``) before it starts; a non-zero
status stops the rest. A :func:`latest_run_under` argument is resolved when its step starts."""
from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

_LATEST = re.compile(r"^\{the latest run under (.+)\}$")


def step_line(cmd: Sequence[str]) -> str:
    return "+ " + " ".join(shlex.quote(c) for c in cmd)


def latest_run_under(save_dir: str) -> str:
    """An argument that stands for the newest training run (a directory with ``latest``) under ``save_dir``."""
    return "{the latest run under %s}" % save_dir


def latest_run(save_dir: str) -> str:
    """The newest training run under ``save_dir``: a directory with ``latest``, not the merged save upstream's
    demos write beside their runs (``merged_lora_<kind>``)."""
    runs = [d for d in glob.glob(os.path.join(save_dir, "*"))
            if os.path.isfile(os.path.join(d, "latest")) and not os.path.basename(d).startswith("merged_lora_")]
    if not runs:
        raise SystemExit(f"error: training wrote no checkpoint under {save_dir}")
    return max(runs, key=os.path.getmtime)


def run(commands: List[List[str]], env: Dict[str, str], cwd: Optional[str] = None, dry_run: bool = False) -> int:
    """Run ``commands`` one after the other (``dry_run``: print them only); the first non-zero status is returned
    and stops the rest."""
    for cmd in commands:
        if not dry_run:
            try:
                cmd = [latest_run(m.group(1)) if m else arg for arg, m in ((a, _LATEST.match(a)) for a in cmd)]
            except SystemExit as exc:
                print(exc, file=sys.stderr, flush=True)
                return 1
        print(step_line(cmd), flush=True)
        code = 0 if dry_run else subprocess.call(cmd, env=env, cwd=cwd)
        if code != 0:
            print(f"error: step failed with exit code {code}: {cmd[0]} {' '.join(cmd[1:4])} ...", file=sys.stderr,
                  flush=True)
            return code
    return 0
