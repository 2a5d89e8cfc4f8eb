"""``python -m sat_patches VERB ...`` is ``sat-patches VERB ...`` (:mod:`sat_patches.cli.main`). A verb with its own
parser (``merge``, ``evaluate``, ``finetune``, ``export``, ``import``: the ones that load torch and SAT) exits
without the interpreter's teardown (:func:`sat_patches.cli.exit_now`)."""
import sys

from .cli import exit_now
from .cli.main import OWN_PARSER, main

code = main()
if sys.argv[1:2] and sys.argv[1] in OWN_PARSER:
    exit_now(code)
sys.exit(code)
