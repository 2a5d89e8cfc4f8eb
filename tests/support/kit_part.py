"""One part of the GPU kit run at tiny size as the kit's parent runs it (``benchmarks/gpu/proof.py --part X``: a
fresh interpreter per part, which starts ranks of its own where the part needs them). The parent's own work (a process
per part, its time limit, the table, ``proof.json``) is the tiny run's check in ``tests/benchmarks/test_gpu_kit.py``."""
import json
import os
import subprocess
import sys

from multirank import base_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROOF = os.path.join(ROOT, "benchmarks", "gpu", "proof.py")


def run_part(part: str, scratch, *options: str, timeout: float = 600):
    """What the part recorded (as ``proof.json`` holds it under ``parts``: its ``rows`` and the rest) and its output;
    ``options`` as the kit takes them."""
    rows_file = os.path.join(str(scratch), f"part_{part}.json")
    run = subprocess.run([sys.executable, PROOF, "--tiny", "--part", part, "--part-json", rows_file, "--scratch",
                          str(scratch), *options], env=base_env({"SAT_PATCHES_DEVICE": "cpu"}), cwd=ROOT,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    with open(rows_file, encoding="utf-8") as f:
        return json.load(f), output
