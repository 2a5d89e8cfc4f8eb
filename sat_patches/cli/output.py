"""What the tools print: their own results on stdout, everything else on stderr."""
import contextlib
import sys


@contextlib.contextmanager
def imports_print_to_stderr():
    """Inside, stdout goes to stderr: what third-party modules print at import stays out of ``--json``."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
