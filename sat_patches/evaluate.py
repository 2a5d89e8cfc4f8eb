"""``python -m sat_patches.evaluate``, the same as ``sat-patches evaluate`` (:mod:`sat_patches.cli.evaluate`); the
evaluation itself is :mod:`sat_patches.cogvlm.evaluation`."""
import sys

from .cli.evaluate import main
from .cogvlm.evaluation import evaluate  # noqa: F401  (for code that imported it from here)

if __name__ == "__main__":
    sys.exit(main())
