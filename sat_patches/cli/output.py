"""What the tools print: their own results on stdout, everything else on stderr."""
import contextlib
import sys


@contextlib.contextmanager
def imports_print_to_stderr():
    """Inside, anything printed to stdout goes to stderr: third-party modules imported here (DeepSpeed
    logs its accelerator choice to stdout at import, and keeps that stream for its later logs) cannot
    mix into a tool's ``--json`` document."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
