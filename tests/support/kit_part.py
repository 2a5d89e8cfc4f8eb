"""One part of the GPU kit run at tiny size as the kit's parent runs it (``benchmarks/gpu/proof.py --part X``), but in
a rank that torchrun starts (as the kit's parent starts each part in an interpreter of its own). The parent's
own work (a process per part, its time limit, the table, ``proof.json``) is the tiny run's check in
``tests/benchmarks/test_gpu_kit.py``."""
import json
import os

from multirank import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROOF = os.path.join(ROOT, "benchmarks", "gpu", "proof.py")


def run_part(part: str, scratch, *options: str, timeout: float = 600):
    """What the part recorded (as ``proof.json`` holds it under ``parts``: its ``rows`` and the rest) and its output;
    ``options`` as the kit takes them."""
    rows_file = os.path.join(str(scratch), f"part_{part}.json")
    [rank] = run_script([PROOF, "--tiny", "--part", part, "--part-json", rows_file, "--scratch", str(scratch),
                         *options], nranks=1, timeout=timeout, env={"SAT_PATCHES_DEVICE": "cpu"}, cwd=ROOT)
    assert rank.ok, rank.output[-8000:]
    with open(rows_file, encoding="utf-8") as f:
        return json.load(f), rank.output
