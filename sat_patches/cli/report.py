"""``sat-patches report RUN_DIR``: draw the memory ledger of a run as a PNG and print its last rows; redraw its loss
curve (a run redraws it at most once a minute while it trains)."""
from __future__ import annotations

import os

from ..diagnostics import ledger_files
from ..diagnostics.charts import CURVE_CSV, draw, draw_loss_curve


def cmd_report(args) -> int:
    path = draw(args.run_dir, args.out)
    rows = ledger_files.read(args.run_dir)
    print(ledger_files.format_table(ledger_files.latest_per_rank(rows), rows, title="last record per rank",
                                    where=args.run_dir))
    print(f"wrote {path}")
    if os.path.isfile(os.path.join(args.run_dir, CURVE_CSV)):
        print(f"wrote {draw_loss_curve(args.run_dir)}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="draw a run's memory ledger (memory over time per rank) and loss curve as PNGs")
    p.add_argument("run_dir", help="the run directory holding memory_ledger_files.csv")
    p.add_argument("--out", default=None, help=f"PNG path (default RUN_DIR/{ledger_files.PNG_NAME})")
    p.set_defaults(func=cmd_report)
