"""Diagnostics of a run: the hang watchdog, rank heartbeats, the memory ledger, the progress line and loss
curve, console output written to files. None of them may end a run."""
