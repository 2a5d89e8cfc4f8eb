"""``python -m sat_patches.export ...`` is ``sat-patches export ...`` (:mod:`sat_patches.cli.export`)."""

import sys

from ..cli.export import main

sys.exit(main())
