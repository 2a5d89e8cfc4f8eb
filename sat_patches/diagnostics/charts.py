"""Charts of a run as PNGs (with matplotlib): the memory ledger (host RSS, CUDA max allocated; one line per rank,
phases marked) and the loss curve.
"""
from __future__ import annotations

import csv
import os
from typing import Optional

from . import ledger_files

FIGSIZE, DPI = (10, 6), 100
CURVE_CSV, CURVE_PNG = "loss_curve.csv", "loss_curve.png"  # a run's loss curve, in its run directory
MARKED = ("build", "load", "split", "lora", "deepspeed_init", "first_step")
# rank 0 solid, the later ranks dashed: ranks holding the same memory (data-parallel ranks often do) draw their lines
# over one another, and an earlier rank's line shows in a later one's gaps
RANK_LINESTYLES = ("-", (0, (4, 5)), (0, (1, 3)), (0, (8, 3, 2, 3)))


def _pyplot():
    try:
        import matplotlib  # optional (the report extra)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError as exc:
        raise RuntimeError("sat-patches report needs matplotlib: pip install 'sat_patches[report]' "
                           "(or pip install matplotlib)") from exc
    return plt


def draw_loss_curve(run_dir: str) -> str:
    """``loss_curve.png`` from the run's ``loss_curve.csv`` (one row per logged step)."""
    with open(os.path.join(run_dir, CURVE_CSV), newline="") as f:
        rows = [(int(r["iteration"]), float(r["loss"])) for r in csv.DictReader(f)]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=DPI)
    ax.plot([i for i, _ in rows], [v for _, v in rows], marker="o", markersize=3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(f"loss: {os.path.basename(os.path.abspath(run_dir))}", fontsize=10)
    ax.grid(True, color="0.9")
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.13, top=0.92)  # tight_layout's result, without its cost
    out = os.path.join(run_dir, CURVE_PNG)
    fig.savefig(out + ".tmp.png", dpi=DPI)
    plt.close(fig)
    os.replace(out + ".tmp.png", out)
    return out


def draw(run_dir: str, out: Optional[str] = None) -> str:
    plt = _pyplot()
    rows = ledger_files.read(run_dir)
    if not rows:
        raise ValueError(f"{os.path.join(run_dir, ledger_files.CSV_NAME)} has no rows")
    t0 = min(r.time for r in rows)
    ranks = sorted({r.rank for r in rows})
    cuda = any(r.cuda_max_alloc_mib for r in rows)
    fig, axes = plt.subplots(2 if cuda else 1, 1, figsize=FIGSIZE, dpi=DPI, sharex=True, squeeze=False)
    series = [("rss_mib", "host RSS (GiB)")] + ([("cuda_max_alloc_mib", "CUDA max allocated (GiB)")] if cuda else [])
    for ax, (key, label) in zip(axes[:, 0], series):
        for position, rank in enumerate(ranks):
            mine = sorted((r for r in rows if r.rank == rank), key=lambda r: r.time)
            xs, ys = [r.time - t0 for r in mine], [getattr(r, key) / 1024 for r in mine]
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=f"rank {rank}",
                    linestyle=RANK_LINESTYLES[position % len(RANK_LINESTYLES)])
            if position == 0:
                marked = [(r, x, y) for r, x, y in zip(mine, xs, ys) if r.phase in MARKED]
                for i, (r, x, y) in enumerate(marked):  # alternate above/below: phases often coincide
                    ax.annotate(r.phase, (x, y), textcoords="offset points", xytext=(3, 6 if i % 2 else -11),
                                fontsize=7, color="0.35")
        ax.set_ylabel(label)
        ax.grid(True, color="0.9")
    axes[0, 0].legend(loc="upper left", fontsize=8, ncol=min(len(ranks), 8))
    flags = ledger_files.flagged(rows)
    title = f"memory ledger: {os.path.basename(os.path.abspath(run_dir))}, {len(ranks)} rank(s)"
    far = sorted(set(flags["host"]) | set(flags["cuda"]))
    if far:
        title += f"; far above the others: rank {', '.join(map(str, far))}"
    axes[0, 0].set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("seconds since the first record")
    fig.tight_layout()
    out = out or os.path.join(run_dir, ledger_files.PNG_NAME)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
