"""Host memory and time of `sat-patches export hf` on a CogVLM checkpoint of over 2 GB, at MP=1 and MP=2.

    python benchmarks/export_memory.py            # LLaMA-7B widths, 2 CogVLM layers, bf16: 2.2 GB
    python benchmarks/export_memory.py --small    # a few MB, to try it out

Writes a CogVLM SAT checkpoint (the released architecture at LLaMA-7B widths: hidden 4096, ffn 11008, vocab
32000, 2 layers with their vision experts, a 2-layer EVA tower; random bf16 values) as one MP=1 shard and as two
MP=2 shards, then exports each in a fresh process with ``export_hf`` and prints: the peak RSS during the export
above the process's RSS just before it (the peak is reset with ``/proc/self/clear_refs``), over the checkpoint's
size, against the target 0.3 x size plus one output shard (``--max-shard-size``, default 500 MB); the export's
wall time over the time of one read of the checkpoint files plus one write of as many bytes (fsynced, as the
export's files are), target <= 2. The checkpoint is read from the page cache by both (it was just written).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _memory import proc_status_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

FULL = dict(num_layers=2, hidden_size=4096, num_attention_heads=32, vocab_size=32000, inner_hidden_size=11008)
SMALL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=4096, inner_hidden_size=512)
EVA = dict(num_layers=2, hidden_size=1792, num_attention_heads=16, inner_hidden_size=15360)
EVA_SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, inner_hidden_size=256)


def config_for(small: bool) -> dict:
    from sat_patches.cogvlm.shapes import upstream_config
    config = upstream_config("cogvlm-base-224")
    config.update(SMALL if small else FULL, max_sequence_length=4096)
    config["eva_args"] = dict(config["eva_args"], **(EVA_SMALL if small else EVA))
    return config


def generate(root: str, small: bool) -> dict:
    """The MP=1 and MP=2 checkpoints (random bf16 values of the model's shapes); returns their sizes."""
    import torch
    import sat_patches  # noqa: F401
    from sat_patches.checkpoints import sharding, writer
    from sat_patches.export.importer import rank_piece
    from sat_patches.cogvlm.on_meta import build_on_meta
    config = config_for(small)
    model = build_on_meta(config)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for key, like in model.state_dict(keep_vars=True).items():
        state[key] = torch.empty(like.shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    sizes = {}
    for mp in (1, 2):
        shards = {}
        for rank in range(mp):
            shards[rank] = {}
            for key, t in state.items():
                path, _, name = key.rpartition(".")
                split = sharding.split_of(model, key, model.get_submodule(path), name)
                shards[rank][key] = rank_piece(t, split, mp, rank)
        folder = os.path.join(root, f"mp{mp}")
        writer.write_layout(folder, 1, {r: {"module": s, "iteration": 1} for r, s in shards.items()},
                            dict(config, model_parallel_size=mp))
        sizes[mp] = sum(os.path.getsize(os.path.join(folder, "1", f)) for f in os.listdir(os.path.join(folder, "1")))
        del shards
    return sizes


def read_and_write(folder: str, scratch: str) -> tuple:
    """Seconds to read every shard file once, and to write (and fsync) as many bytes."""
    files = [os.path.join(folder, "1", f) for f in sorted(os.listdir(os.path.join(folder, "1")))]
    block = 64 * 2**20
    start = time.perf_counter()
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(block):
                total += len(chunk)
    read = time.perf_counter() - start
    data = b"\1" * block
    start = time.perf_counter()
    with open(scratch, "wb") as f:
        left = total
        while left > 0:
            f.write(data[:min(block, left)])
            left -= block
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - start
    os.remove(scratch)
    return read, write


def export_once(folder: str, out: str, shard_bytes: int) -> dict:
    """(fresh process) Export ``folder``; peak RSS above the RSS before the export, and its wall time."""
    import sat_patches  # noqa: F401
    import sat  # noqa: F401  (imports and patches first: not the export's memory)
    from sat_patches.export.hf import export_hf
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_bytes("VmRSS")
    start = time.perf_counter()
    info = export_hf(folder, out, max_shard_bytes=shard_bytes)
    seconds = time.perf_counter() - start
    return {"peak": proc_status_bytes("VmHWM") - before, "seconds": seconds, "shards": info["shards"],
            "bytes": info["bytes"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--max-shard-size", type=float, default=500, metavar="MB")
    p.add_argument("--workdir", default=None)
    p.add_argument("--child", nargs=3, metavar=("CKPT", "OUT", "SHARD_BYTES"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(export_once(a.child[0], a.child[1], int(a.child[2]))))
        return 0
    shard_bytes = int(a.max_shard_size * 10**6)
    with tempfile.TemporaryDirectory(dir=a.workdir) as root:
        start = time.perf_counter()
        sizes = generate(root, a.small)
        print(f"generated MP=1 {sizes[1] / 1e9:.2f} GB and MP=2 {sizes[2] / 1e9:.2f} GB checkpoints in "
              f"{time.perf_counter() - start:.0f} s")
        print("| MP | checkpoint GB | shards out | peak RSS GB | / ckpt | target (0.3 x ckpt + shard) GB | export s "
              "| read s | write s | / (read + write) | target |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        ok = True
        for mp in (1, 2):
            folder, out = os.path.join(root, f"mp{mp}"), os.path.join(root, f"hf{mp}")
            read, write = read_and_write(folder, os.path.join(root, "scratch"))
            env = dict(os.environ, OMP_NUM_THREADS="1")
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", folder, out, str(shard_bytes)],
                                 env=env, capture_output=True, text=True, cwd=HERE)
            if run.returncode:
                print(run.stdout, run.stderr, file=sys.stderr)
                return 1
            got = json.loads(run.stdout.strip().splitlines()[-1])
            size = sizes[mp]
            memory_target = 0.3 * size + shard_bytes
            ratio = got["seconds"] / (read + write)
            ok &= got["peak"] <= memory_target and ratio <= 2
            print(f"| {mp} | {size / 1e9:.2f} | {got['shards']} | {got['peak'] / 1e9:.3f} | {got['peak'] / size:.3f} | "
                  f"{memory_target / 1e9:.2f} | {got['seconds']:.2f} | {read:.2f} | {write:.2f} | {ratio:.2f} | <= 2 |")
            import shutil
            shutil.rmtree(out)
        print("targets met" if ok else "TARGETS MISSED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
