"""Read this process's memory counters from /proc (Linux), exact to the kB: both benchmarks use it.
(Not sat_patches.diagnostics.ledger_files.host_memory: importing sat_patches arms the patches for the next
``import sat``, and the stock variant must stay stock.)"""


def proc_status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def proc_pss_bytes() -> int:
    """Proportional set size of this process (``/proc/self/smaps_rollup``): each resident page divided
    by the number of processes mapping it, so the ranks of a node sharing a file's pages count it once."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise KeyError("Pss")
