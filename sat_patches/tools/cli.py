"""``sat_patches.tools.cli:main``, the console entry point of installs made before the command moved to
:mod:`sat_patches.cli.main` (an editable install keeps its old ``sat-patches`` launcher until reinstalled)."""
from ..cli.main import main  # noqa: F401
