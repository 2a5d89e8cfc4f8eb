"""Shared check: `sat-patches report RUN_DIR` draws one line per rank (the memory ledger of every rank in one chart),
and redraws the run's loss curve."""
import os

from PIL import Image

from sat_patches.cli.main import main
from sat_patches.diagnostics.charts import CURVE_CSV, CURVE_PNG

RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c"]  # matplotlib's first line colours: rank 0, 1, 2


def pixels_near(pixels, hex_color, tolerance=30):
    target = tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return sum(1 for p in pixels if all(abs(a - b) <= tolerance for a, b in zip(p, target)))


def assert_report_has_one_line_per_rank(run_dir, png, ranks=2):
    curve = os.path.join(run_dir, CURVE_PNG)
    if os.path.exists(curve):
        os.remove(curve)
    assert main(["report", str(run_dir), "--out", str(png)]) == 0
    assert os.path.isfile(os.path.join(run_dir, CURVE_CSV)) and os.path.getsize(curve) > 5_000
    image = Image.open(png).convert("RGB")
    assert image.size == (1000, 600)
    pixels = list(image.getdata())
    for colour in RANK_COLOURS[:ranks]:
        assert pixels_near(pixels, colour) > 500, colour
    assert pixels_near(pixels, RANK_COLOURS[ranks]) == 0   # no line for a rank that does not exist
