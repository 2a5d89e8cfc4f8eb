"""``python -m sat_patches.merge``, the same as ``sat-patches merge`` (:mod:`sat_patches.cli.merge`); the merge
itself is :mod:`sat_patches.checkpoints.merge`."""

import sys

from .checkpoints.merge import MergeError, merge  # noqa: F401  (for code that imported them from here)
from .cli.merge import main

if __name__ == "__main__":
    sys.exit(main())
