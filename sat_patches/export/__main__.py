"""``python -m sat_patches.export ...`` is ``sat-patches export ...`` (:mod:`sat_patches.cli.export`)."""

from ..cli import exit_now
from ..cli.export import main

exit_now(main())
