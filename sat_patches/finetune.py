"""``python -m sat_patches.finetune``, the same as ``sat-patches finetune`` (:mod:`sat_patches.cli.finetune`); the
trainer itself is :mod:`sat_patches.cogvlm.standalone`."""

import sys

from .cli.finetune import main
from .cogvlm.standalone import train  # noqa: F401  (for code that imported it from here)

if __name__ == "__main__":
    sys.exit(main())
