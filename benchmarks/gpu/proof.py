"""The GPU proof kit: every CUDA path and the full-size memory claims, in one call on one GPU.

    python benchmarks/gpu/proof.py --out DIR            # on a GPU machine (see prepare.sh for the call)
    python benchmarks/gpu/proof.py --tiny --out DIR     # tiny models on the CPU: the kit's own check

Parts, each in its own process with its own time limit, so one that fails, runs out of memory or
hangs cannot hide the others (order c, s, a, b, p: the quick checks first):

c. CUDA paths (``proof_cuda.py``): triton rotary == torch fallback, xformers stand-in == math, LoRA and
   mixins on the device in bf16, CUDA RNG tracker restored bit for bit, the ledger's CUDA figures,
   ``cpu:gloo,cuda:nccl`` at world size 1.
a. Full-size CogVLM-17B and CogAgent-18B LoRA steps beside the plan's 1 x 80 GB row, sat_patches and stock SAT
   (``proof_steps.py``).
b. QLoRA from a bf16 checkpoint on local disk beside the plan's 1 x 24 GB row (``proof_steps.py``).
s. Two ranks sharing the card through the host relay (``proof_shared.py``, ``SAT_PATCHES_SHARED_GPU=1``): both
   on ``cuda:0``, the collectives SAT and DeepSpeed ZeRO-2 use, a CPU tensor refused on the CUDA-only group.
p. The peer beside us (``proof_peer.py``): the released model's own HF code with PEFT and SAT + sat_patches,
   the same CogVLM LoRA step at the same settings; tokens/s, peak memory, useful-FLOP utilisation and the
   ratio. Needs ``--hf-code DIR`` (a local copy of cogvlm-chat-hf's remote code) and, on the GPU machine,
   ``--peer-site DIR`` (transformers 4.41.2 and peft 0.11.1, installed apart); otherwise ``skipped``.
h. The README's Hugging Face recipes on an export (``proof_recipes.py``): a kit-made CogVLM (2 full-width layers
   on the GPU, tiny with ``--tiny``) exported with ``export hf --hf-code`` and ``export peft``; bf16 load with SAT's
   logits and 3 generated tokens, 4-bit load beside it, the PEFT adapter on the exported base with SAT's LoRA
   logits. Not in the default parts; needs ``--hf-code DIR`` as part p, otherwise each recipe's row is ``skipped``.

u. The user's own path on the card (``proof_fork.py``): a CogVLM checkout's demo through ``finetune_cogvlm.sh`` at
   MP=2, two ranks sharing the card (``SAT_PATCHES_SHARED_GPU=1``), full width with 2 language and 2 EVA layers: steps
   and saves, a resume, ``sat-patches merge`` and ``export hf``, the export in transformers' ``LlamaForCausalLM``,
   per-rank peaks beside the plan. Needs ``--checkout DIR`` (a CogVLM checkout), otherwise ``skipped``.
w. The full-size CogVLM-17B through the same path at MP=2 on one card, when the card holds both ranks (a 141 GB
   card; skipped with the reason on an 80 GB one). Needs ``--checkout DIR``.
l. The speed ladder (``proof_ladder.py``): the peer (as part p) and our step with each lever added in turn (routing,
   layers unchecked, selective, compiled) at the plan's settings for 80 GB (memory capped) and for the card's own
   size: step time, tokens/s, peak, ratio to the peer, useful-FLOP utilisation, the plan's predicted step beside each.
   Not in the default parts; needs ``--hf-code DIR`` as part p for the peer's rows.

Prints one table (part, check, status, measured, expected, seconds, detail) and writes ``proof.json``
(the same rows, the machine, and per part the distributions it imported and the modules stood in) to
``--out`` (default ``$OUT``, else ``./gpu_proof``). A status is ``ok``, ``FAIL`` or ``skipped: <why>``
(``skipped: no CUDA`` for the CUDA-only checks of a ``--tiny`` run). Exit status 0 when no row failed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PARTS = {"c": ("CUDA paths", 60), "a": ("full-size LoRA steps, 1 x 80 GB", 260),
         "b": ("QLoRA from a bf16 checkpoint, 1 x 24 GB", 200),
         "p": ("the peer beside us: HF + PEFT and SAT + sat_patches", 240),
         "s": ("two ranks sharing the card: the host relay", 60),
         "h": ("the README's Hugging Face recipes on an export", 180),
         "u": ("the user's path: a checkout's demo at MP=2, two ranks sharing the card", 300),
         "w": ("full-size CogVLM-17B at MP=2, two ranks sharing the card", 540),
         "l": ("speed ladder: the peer and our step with each lever added in turn", 420)}  # part: (title, seconds allowed on an H100)
COLUMNS = ("part", "check", "status", "measured", "expected", "seconds", "detail")


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_proof", help="folder for proof.json")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the kit's own test)")
    parser.add_argument("--parts", default="csabp", help="which parts, in order (default: csabp)")
    parser.add_argument("--hf-code", help="parts p, h and l: folder with cogvlm-chat-hf's modeling_cogvlm.py, visual.py, "
                                          "configuration_cogvlm.py")
    parser.add_argument("--peer-site", help="parts p, h and l: folder with transformers 4.41.2 and peft 0.11.1 installed "
                                            "(put first on sys.path in that part only)")
    parser.add_argument("--checkout", help="parts u and w: a CogVLM checkout (holds utils/ and finetune_demo/)")
    parser.add_argument("--scratch", default=None, help="local disk for part b's checkpoint (default: a temp dir)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every part's time limit")
    parser.add_argument("--part", help=argparse.SUPPRESS)        # run one part in this process (the workers)
    parser.add_argument("--part-json", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    unknown = set(opts.parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts takes letters of {''.join(PARTS)}, not {''.join(sorted(unknown))}")
    return opts


# --------------------------------------------------------------------------------------
# One part, in its own process
# --------------------------------------------------------------------------------------

def run_part(part: str, tiny: bool, json_path: str, scratch: str, hf_code=None, peer_site=None,
             checkout=None) -> None:
    # tests/support: the test kit's run_ranks (part s starts its two ranks with it)
    sys.path[:0] = [HERE, ROOT, os.path.join(os.path.dirname(HERE), "calibration"),
                    os.path.join(ROOT, "tests", "support")]
    from proof_record import Recorder, stand_in_unused
    if part in ("p", "h", "l"):
        import proof_peer
        proof_peer.prepare_imports(peer_site)  # before SAT, which imports transformers
    stand_in_unused(os.path.join(scratch, f"stand_ins_{part}"))
    if tiny:
        os.environ.setdefault("SAT_PATCHES_DEVICE", "cpu")
    import sat_patches  # noqa: F401  (before SAT: the patches go on when SAT is imported)
    import sat  # noqa: F401  (now, before any of the parts imports a library module of ours that SAT's patches use)
    rec = Recorder(part, json_path, extra={"machine": machine()})  # CUDA starts in the parts only
    rec.save()
    if part == "c":
        import proof_cuda
        proof_cuda.run(rec, tiny)
    elif part == "a":
        import proof_steps
        rec.guarded(proof_steps.full_size_steps, tiny)
    elif part == "b":
        import proof_steps
        rec.guarded(proof_steps.qlora, tiny, scratch)
    elif part == "p":
        rec.guarded(proof_peer.run, tiny, hf_code)
    elif part == "s":
        import proof_shared
        rec.guarded(proof_shared.run, tiny)
    elif part == "h":
        import proof_recipes
        rec.guarded(proof_recipes.run, tiny, hf_code)
    elif part == "l":
        import proof_ladder
        rec.guarded(proof_ladder.run, tiny, hf_code)
    elif part in "uw":
        import proof_fork
        rec.guarded(proof_fork.run if part == "u" else proof_fork.whole, tiny, checkout, scratch)
    rec.save()


# --------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------

def machine() -> dict:
    """Python, torch, and the GPU (a part's process: the parent leaves CUDA alone, so no context of its own
    holds GPU memory while the parts run)."""
    info = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1), cuda=torch.version.cuda)
    except Exception as exc:  # noqa: BLE001
        info["torch"] = f"not importable: {exc}"
    return info


def spawn(part: str, opts, json_path: str, scratch: str) -> dict:
    """Run ``part`` in a child process within its time limit; its rows, plus one for a crash or timeout."""
    title, allowed = PARTS[part]
    limit = allowed * opts.time_scale
    isolated = ["-S"] if sys.flags.no_site else []  # a run that sees only some packages: so do its parts
    cmd = [sys.executable, *isolated, os.path.abspath(__file__), "--part", part, "--part-json", json_path, "--scratch", scratch]
    if opts.tiny:
        cmd.append("--tiny")
    for flag, value in (("--hf-code", opts.hf_code), ("--peer-site", opts.peer_site), ("--checkout", opts.checkout)):
        if value:
            cmd += [flag, os.path.abspath(value)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    print(f"== part {part}: {title} (limit {limit:.0f} s)", flush=True)
    try:
        code = subprocess.run(cmd, env=env, timeout=limit).returncode
        ended = None if code == 0 else f"the part's process ended with status {code}"
    except subprocess.TimeoutExpired:
        ended = f"stopped at its time limit ({limit:.0f} s)"
    seconds = round(time.perf_counter() - start, 1)
    try:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {"part": part, "rows": [], "imports": [], "stood_in": []}
    if ended:
        data["rows"].append({"part": part, "check": f"part {part} ({title})", "status": "FAIL", "measured": "",
                             "expected": f"done within {limit:.0f} s", "seconds": seconds, "detail": ended})
    data.update(title=title, seconds=seconds, limit=limit)
    return data


def table(rows) -> str:
    cells = [[str(r.get(c, "")) for c in COLUMNS] for r in rows]
    widths = [min(60, max([len(c)] + [len(row[i]) for row in cells])) for i, c in enumerate(COLUMNS)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.replace("|", "/") for v in row) + " |" for row in cells]
    return "\n".join(lines)


DEVICE_CALL_S = 600
"""The device tool's limit on one command: a run of parts longer than this needs several calls."""


def cost_preview(parts: str, time_scale: float = 1.0) -> str:
    """What the chosen parts will cost at most (their limits), said before anything runs."""
    limits = [(p, PARTS[p][0], PARTS[p][1] * time_scale) for p in parts]
    total = sum(limit for _, _, limit in limits)
    lines = [f"parts {parts}: up to {total:.0f} s of device time in all (machine start not counted)"]
    lines += [f"  {p}: {title}, up to {limit:.0f} s" for p, title, limit in limits]
    if total > DEVICE_CALL_S:
        lines.append(f"  more than one device call allows ({DEVICE_CALL_S} s): run a subset per call "
                     f"(--parts), e.g. the quick checks first")
    return "\n".join(lines)


def main(argv=None) -> int:
    opts = options(argv)
    if opts.part:
        run_part(opts.part, opts.tiny, opts.part_json, opts.scratch or tempfile.gettempdir(), opts.hf_code,
                 opts.peer_site, opts.checkout)
        # its rows are written; a process group still up goes before the interpreter's teardown, in which gloo's
        # threads once aborted a tiny part b on CPU after its last row (pytorch/pytorch#190489)
        from sat_patches.runtime.distributed import destroy_group_at_exit
        destroy_group_at_exit()
        return 0
    print(cost_preview(opts.parts, opts.time_scale), flush=True)
    os.makedirs(opts.out, exist_ok=True)
    result = {"tiny": opts.tiny, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {}, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="sat-patches-proof-", dir=opts.scratch) as scratch:
        for part in opts.parts:
            result["parts"][part] = spawn(part, opts, os.path.join(scratch, f"part_{part}.json"), scratch)
            result["machine"] = result["machine"] or result["parts"][part].get("machine", {})
            result["rows"] = [r for p in result["parts"].values() for r in p["rows"]]
            write_json(os.path.join(opts.out, "proof.json"), result)
    rows = result["rows"]
    print("\n" + table(rows))
    failed = [r for r in rows if r["status"] == "FAIL"]
    print(f"\n{len(rows)} checks: {sum(r['status'] == 'ok' for r in rows)} ok, {len(failed)} failed, "
          f"{sum(r['status'].startswith('skipped') for r in rows)} skipped; {os.path.join(opts.out, 'proof.json')}")
    return 1 if failed else 0


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
