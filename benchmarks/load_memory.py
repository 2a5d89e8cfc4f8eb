"""Host memory and time of loading a SAT checkpoint, stock SAT vs sat_patches, at MP=1 and MP=2.

    python benchmarks/load_memory.py            # LLaMA-7B widths, 2 layers + 1 vision-expert layer, bf16
    python benchmarks/load_memory.py --small    # a few MB, to try it out

Saves a CogVLM-architecture-like SAT checkpoint (``tests/support/expert_llama.py``: LLaMA with
vision-expert attention and MLP layers whose mixins default to CPU/fp32 as CogVLM's do; about
1.7 GB in bf16 by default), then loads it with ``from_pretrained`` on 2 CPU ranks:

* MP=1: ``from_pretrained(path, args)`` (each rank holds the whole model);
* MP=2: ``from_pretrained(path, args, overwrite_args={'model_parallel_size': 2})``;

once with stock SAT and once with sat_patches (at MP=1 also with ``SAT_PATCHES_LOAD_ZERO_COPY=0``, its
copy path), each in fresh processes. Stock SAT's MP=2 path calls ``Tensor.cuda()`` before ``send``;
that call is stood in by the identity on this CPU machine.

Printed per rank: peak RSS during the load above the idle baseline (after imports and process-group
set-up; the peak is reset with ``/proc/self/clear_refs``) divided by the checkpoint's size (targets
for sat_patches: MP=2 <= 0.6, MP=1 <= 1.1); load wall time divided by the time to read the file once
(from the page cache, as the loads read it; target for sat_patches at MP=1: <= 1.5); the time of a
first pass that reads every byte of every parameter (the maximum of its bytes, at memory speed: pages
a load did not touch fault in here) and load plus that pass over one read; after that pass, the
anonymous memory (``RssAnon``: the process's own copies), the mapped file pages (``RssFile``: page
cache, shared by the ranks of a node) and the proportional set size (``Pss``: a page mapped by both ranks
counts half in each) above the baseline, over the checkpoint's size; last, the time
of the checksum pass (every parameter summed in float64: compute-bound) and the checksum, which checks
that every loader gave every rank the same weights.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

from _memory import proc_pss_bytes, proc_status_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))  # tests/support: the test kit (run_ranks, tiny models)

FULL = dict(num_layers=2, hidden_size=4096, num_attention_heads=32, vocab_size=32000, inner_hidden_size=11008,
            num_vision_layers=1)
SMALL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=4096, inner_hidden_size=512,
             num_vision_layers=1)
TARGETS = {1: 1.1, 2: 0.6}
TIME_TARGET = 1.5  # sat_patches' load at MP=1 over one read of the file
VARIANTS = [  # (name, stock SAT?, environment, model-parallel sizes)
    ("stock SAT", True, {}, (1, 2)),
    ("sat_patches", False, {}, (1, 2)),
    ("copy path", False, {"SAT_PATCHES_LOAD_ZERO_COPY": "0"}, (1,)),
]


def save(path: str, cfg: dict) -> int:
    """(one rank) Build the model in bf16, give it values, write the SAT checkpoint; returns bytes."""
    import torch
    import torch.distributed as dist
    from sat import mpu
    import expert_llama as el
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1)
    args = el.build_args(el.config(**cfg), bf16=True, skip_init=True)
    model = el.model_class()(args, params_dtype=torch.bfloat16).bfloat16()
    el.fill_(model, seed=0)
    el.write_checkpoint(model, el.config(**cfg), path)
    return os.path.getsize(os.path.join(path, "1", "mp_rank_00_model_states.pt"))


def measure(path: str, mp: int, stock: bool) -> dict:
    """(every rank) Load ``path`` at MP=``mp``: peak RSS above the idle baseline, wall time, time of a first read of
    every weight and memory after it, checksum and its time."""
    import torch
    import torch.distributed as dist
    import expert_llama as el
    if stock:
        torch.Tensor.cuda = lambda self, *a, **kw: self  # SAT's rank-0 split path calls .cuda() before send
    dist.init_process_group("gloo")
    cls = el.model_class()
    args = cls.get_args(bf16=True, mode="inference", skip_init=True)
    overwrite = {"model_parallel_size": mp} if mp > 1 else {}
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    baseline, anon, file = (proc_status_bytes(k) for k in ("VmRSS", "RssAnon", "RssFile"))
    pss = proc_pss_bytes()
    start = time.perf_counter()
    model, _ = cls.from_pretrained(path, args, overwrite_args=overwrite)
    elapsed = time.perf_counter() - start
    peak = proc_status_bytes("VmHWM")
    from mappings import first_read
    start = time.perf_counter()
    first_read(model.parameters())
    touch = time.perf_counter() - start
    anon, file = proc_status_bytes("RssAnon") - anon, proc_status_bytes("RssFile") - file
    dist.barrier()  # both ranks have touched their weights: shared pages count half
    pss = proc_pss_bytes() - pss
    start = time.perf_counter()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    summed = time.perf_counter() - start
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    dist.barrier()
    return dict(rank=dist.get_rank(), extra=peak - baseline, baseline=baseline, seconds=elapsed, touch=touch,
                anon=anon, file=file, pss=pss, summed=summed, checksum=checksum, dtypes=dtypes)


def read_once(path: str) -> float:
    """Seconds to read ``path`` once, sequentially, in 64 MiB chunks."""
    buf = bytearray(64 * 2**20)
    view = memoryview(buf)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - start


def options(doc: str, argv=None) -> argparse.Namespace:
    """The command line every checkpoint benchmark takes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a few-MB model (smoke test)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=900)
    return parser.parse_args(argv)


@contextlib.contextmanager
def saved_checkpoint(opts, prefix: str, cfg: dict):
    """``with saved_checkpoint(opts, prefix, cfg) as (path, size):`` the bf16 checkpoint of ``cfg`` :func:`save` writes
    (in its own process) into a temporary directory under ``opts.dir``, removed afterwards; the
    block gets ``None`` (and the output is printed) when writing fails."""
    from multirank import run_ranks
    with tempfile.TemporaryDirectory(prefix=prefix, dir=opts.dir) as tmp:
        path = os.path.join(tmp, "ckpt")
        [saved] = run_ranks("load_memory:save", 1, args=(path, cfg),
                            timeout=opts.timeout)
        if not saved.ok:
            print(saved.output[-4000:])
        yield (path, saved.result) if saved.ok else None


def main(argv=None) -> int:
    opts = options(__doc__, argv)
    from multirank import run_ranks

    cfg = SMALL if opts.small else FULL
    with saved_checkpoint(opts, "satp-load-", cfg) as saved:
        if saved is None:
            return 1
        path, size = saved
        file = os.path.join(path, "1", "mp_rank_00_model_states.pt")
        read_once(file)  # into the page cache, as the loads will find it
        read_s = min(read_once(file) for _ in range(3))
        print(f"checkpoint: {size / 2**30:.2f} GiB ({cfg}); read once: {read_s:.2f} s\n")
        print(f"{'loader':<12}{'MP':>3}{'rank':>5}{'peak RSS - idle':>17}{'/ ckpt':>8}{'target':>8}"
              f"{'load s':>8}{'/ read':>8}{'touch s':>9}{'+touch / read':>15}{'anon / ckpt':>13}{'file / ckpt':>13}{'Pss / ckpt':>12}"
              f"{'sum s':>7}  checksum")
        rows, ok, ratios = {}, True, {}
        for mp in (1, 2):
            for name, stock, env, sizes in VARIANTS:
                if mp not in sizes:
                    continue
                results = run_ranks("load_memory:measure", 2, args=(path, mp, stock), timeout=opts.timeout,
                                    patches="stock" if stock else True, env=env)
                for r in results:
                    if not r.ok:
                        print(f"{name:<12}{mp:>3}{r.rank:>5}  failed:\n{(r.exception or r.output)[-3000:]}")
                        ok = False
                        continue
                    m = r.result
                    ratio = m["extra"] / size
                    target = "" if stock else f"<= {TARGETS[mp]}"
                    same = rows.get((mp, r.rank))
                    check = "" if same is None else ("same as stock" if abs(same - m["checksum"]) < 1e-6 * max(1, abs(same)) else "DIFFERS")
                    rows.setdefault((mp, r.rank), m["checksum"])
                    ratios.setdefault((name, mp), []).append(
                        (m["seconds"] / read_s, (m["seconds"] + m["touch"]) / read_s))
                    print(f"{name:<12}{mp:>3}{r.rank:>5}{m['extra'] / 2**30:>13.2f} GiB{ratio:>8.2f}{target:>8}"
                          f"{m['seconds']:>8.2f}{m['seconds'] / read_s:>8.2f}{m['touch']:>9.2f}"
                          f"{(m['seconds'] + m['touch']) / read_s:>15.2f}{m['anon'] / size:>13.2f}{m['file'] / size:>13.2f}{m['pss'] / size:>12.2f}"
                          f"{m['summed']:>7.2f}  {m['checksum']:.6g} {check}")
                    if not stock and (ratio > TARGETS[mp] or check == "DIFFERS"):
                        ok = False
        print()
        for name, _, _, _ in VARIANTS[1:]:
            if (name, 1) in ratios:
                load, both = zip(*ratios[(name, 1)])
                print(f"{name}, MP=1, over one read: load {', '.join(f'{x:.2f}' for x in load)} (target <= "
                      f"{TIME_TARGET}: {'met' if max(load) <= TIME_TARGET else 'not met'}); load + touch "
                      f"{', '.join(f'{x:.2f}' for x in both)}")
        print("\nall sat_patches memory figures within target" if ok else "\nSOME FIGURES MISS THEIR TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
