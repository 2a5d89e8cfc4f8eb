"""``python -m sat_patches VERB ...`` is ``sat-patches VERB ...`` (:mod:`sat_patches.cli.main`)."""
import sys

from .cli.main import main

sys.exit(main())
