"""A free TCP port on loopback, for a rendezvous that must not collide with another local job."""
import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
SPAN = 12000  # how many ports below the kernel's ephemeral range are candidates


def ephemeral_range():
    """The ports the kernel gives outgoing connections and ``bind(port 0)`` (Linux's default where unreadable)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now, at random below the ephemeral range (inside it an outgoing connection can take the port
    before the rendezvous binds it: EADDRINUSE)."""
    low, _ = ephemeral_range()
    candidates = range(max(1024, low - SPAN), low)
    for port in random.Random().sample(candidates, min(200, len(candidates))):
        if _bindable(port):
            return port
    with socket.socket() as s:  # nothing free below the range: any port the kernel has
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
