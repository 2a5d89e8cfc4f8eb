"""One run saving into a checkpoint folder at a time: the first save of a run takes an exclusive ``flock`` on
``<save>/.saving.lock`` and holds it for the run's life, with the holder's host and process id written in the
file. A second run is refused, naming the file and its holder. The kernel releases the lock when its process
ends, however it ends: a run stopped mid-save leaves the file behind, never the lock. Where the file system
has no locks, saves go on with a warning.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import warnings
from typing import Dict, Tuple

from ..core.registry import SatPatchesWarning

LOCK_NAME = ".saving.lock"
_held: Dict[str, Tuple[int, str]] = {}  # lock file's real path -> (its open descriptor, this run's token)


class SaveLockError(RuntimeError):
    """Another live run is saving into the same folder."""


def acquire(folder: str) -> str:
    """Hold ``folder``'s save lock for this process (again, if it holds it already); its run token.
    :class:`SaveLockError` while another live run holds it."""
    path = os.path.join(folder, LOCK_NAME)
    key = os.path.realpath(path)
    if key in _held:  # a second flock on a new descriptor would conflict with our own
        return _held[key][1]
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    token = f"{host}-{os.getpid()}"  # this process's name in the lock and the staging folder
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        os.close(fd)
        raise SaveLockError(f"another run is saving into '{folder}' ({_describe(holder)}, '{path}'): give this "
                            f"run its own --save folder") from None
    except OSError as exc:  # a file system without locks (e.g. Lustre mounted without flock): saves go on
        warnings.warn(f"'{path}' cannot be locked ({exc.strerror}): a second run saving into '{folder}' is not "
                      f"refused", SatPatchesWarning, stacklevel=2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": token}).encode(), 0)
    _held[key] = (fd, token)  # never closed: the lock lasts as long as this process
    return token


def _describe(holder: str) -> str:
    try:
        record = json.loads(holder)
        return f"process {record['pid']} on host {record['host']}"
    except (ValueError, TypeError, KeyError):
        return "holder not yet written"
