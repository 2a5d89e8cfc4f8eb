"""The memory ledger's files: rows, the CSV/JSON a run writes, the table printed, flagged ranks (without
torch or SAT, so ``sat-patches report`` starts at once).
"""
from __future__ import annotations

import csv
import json
import os
import resource
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional

CSV_NAME, JSON_NAME, PNG_NAME = "memory_ledger.csv", "memory_ledger.json", "memory_ledger.png"
MiB = 2 ** 20
FAR_ABOVE_RATIO = 1.25      # a rank is flagged when its peak exceeds the others' median by this factor
FAR_ABOVE_MIN_MIB = 512     # ... and by at least this much


@dataclass
class Row:
    rank: int
    phase: str
    iteration: int
    time: float             # unix time
    elapsed: float          # seconds since this rank's ledger started
    rss_mib: float
    rss_peak_mib: float
    cuda_alloc_mib: float = 0.0
    cuda_max_alloc_mib: float = 0.0
    cuda_reserved_mib: float = 0.0
    cuda_max_reserved_mib: float = 0.0


FIELDS = [f.name for f in fields(Row)]


def host_memory() -> Dict[str, float]:
    """This process's resident set now and at its peak (VmRSS/VmHWM), MiB."""
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "rss_peak_mib": int(status["VmHWM"].split()[0]) / 1024}
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"rss_mib": peak, "rss_peak_mib": peak}


def append(path: str, rows: List[Row], fresh: bool) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w" if fresh else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if fresh:
            writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def write(run_dir: str, new: List[Row], everything: List[Row], fresh: bool = False) -> None:
    """Rank 0: append ``new`` to the run's CSV (a new file when ``fresh``) and rewrite the JSON."""
    append(os.path.join(run_dir, CSV_NAME), new, fresh or not os.path.exists(os.path.join(run_dir, CSV_NAME)))
    with open(os.path.join(run_dir, JSON_NAME), "w") as f:
        json.dump({"rows": [asdict(r) for r in everything], "flagged": flagged(everything)}, f, indent=1)


def read_csv(path: str) -> List[Row]:
    with open(path, newline="") as f:
        return [Row(**{k: (v if k == "phase" else (int(float(v)) if k in ("rank", "iteration") else float(v)))
                       for k, v in r.items()}) for r in csv.DictReader(f)]


def read(run_dir: str) -> List[Row]:
    """The run's rows (rank 0's table)."""
    path = os.path.join(run_dir, CSV_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {CSV_NAME} in {run_dir}: run with sat_patches applied and --save set "
                                f"until the first training step")
    return read_csv(path)


def latest_per_rank(rows: List[Row]) -> List[Row]:
    last = {r.rank: r for r in rows}  # each rank's latest row
    return [last[k] for k in sorted(last)]


def peaks(rows: List[Row]) -> Dict[int, Dict[str, float]]:
    """Per rank: the largest host peak and CUDA max reserved seen so far."""
    out: Dict[int, Dict[str, float]] = {}
    for r in rows:
        p = out.setdefault(r.rank, {"host": 0.0, "cuda": 0.0})
        p["host"] = max(p["host"], r.rss_peak_mib)
        p["cuda"] = max(p["cuda"], r.cuda_max_reserved_mib)
    return out


def far_above(values: Dict[int, float], ratio: float = FAR_ABOVE_RATIO,
              min_mib: float = FAR_ABOVE_MIN_MIB) -> Dict[int, str]:
    """Ranks whose value exceeds the median of the other ranks by ``ratio`` and by ``min_mib``."""
    out = {}
    for rank, value in values.items():
        others = [v for k, v in values.items() if k != rank]
        if not others:
            continue
        median = statistics.median(others)
        if value > ratio * median and value - median >= min_mib:
            out[rank] = f"{value:.0f} MiB vs the others' median {median:.0f} MiB ({value / max(median, 1):.1f}x)"
    return out


def flagged(rows: List[Row]) -> Dict[str, Dict[int, str]]:
    p = peaks(rows)
    return {"host": far_above({k: v["host"] for k, v in p.items()}),
            "cuda": far_above({k: v["cuda"] for k, v in p.items()})}


def format_table(shown: List[Row], everything: List[Row], title: str = "", where: Optional[str] = None) -> str:
    cuda = any(r.cuda_max_reserved_mib for r in everything)
    head = f"{'rank':>4}  {'phase':<14} {'iter':>6} {'RSS MiB':>9} {'RSS peak':>9}"
    if cuda:
        head += f" {'CUDA alloc':>10} {'max alloc':>10} {'reserved':>10} {'max resv':>10}"
    flags = flagged(everything)
    lines = [f"[sat_patches memory ledger] {title}".rstrip() + (f" -> {where}" if where else
                                                               " (set --save to keep it)"),
             head]
    for r in shown:
        line = f"{r.rank:>4}  {r.phase:<14} {r.iteration:>6} {r.rss_mib:>9.0f} {r.rss_peak_mib:>9.0f}"
        if cuda:
            line += (f" {r.cuda_alloc_mib:>10.0f} {r.cuda_max_alloc_mib:>10.0f} {r.cuda_reserved_mib:>10.0f}"
                     f" {r.cuda_max_reserved_mib:>10.0f}")
        lines.append(line)
    for kind, ranks in flags.items():
        for rank, why in sorted(ranks.items()):
            lines.append(f"  ! rank {rank} is far above the others in {'host RSS' if kind == 'host' else 'CUDA memory'}: "
                         f"{why}")
    return "\n".join(lines)
