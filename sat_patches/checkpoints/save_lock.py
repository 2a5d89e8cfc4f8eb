"""One run saving into a checkpoint folder at a time: the first save of a run takes ``<save>/.saving.lock``
(created exclusively, naming the holder's host, process id and run token). A second run is refused while the
holder lives; a lock whose holder on this host is gone is taken over with a warning; one held from another host
is refused, naming the file to delete. The lock is released when its process exits.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import socket
import warnings
from typing import Dict, Optional

from ..core.registry import SatPatchesWarning

LOCK_NAME = ".saving.lock"


class SaveLockError(RuntimeError):
    """Another live run is saving into the same folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _read(path: str) -> Optional[Dict]:
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _create(path: str, record: Dict) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def acquire(folder: str) -> str:
    """Hold ``folder``'s save lock for this process (again, if it holds it already); its run token.
    :class:`SaveLockError` while another live run holds it."""
    path = os.path.join(folder, LOCK_NAME)
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    token = f"{host}-{os.getpid()}"  # this process's name in the lock and the staging folder
    record = {"host": socket.gethostname(), "pid": os.getpid(), "token": token}
    for _ in range(3):
        if _create(path, record):
            atexit.register(release, folder, token)
            return token
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile
        if holder.get("token") == token:
            return token
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            warnings.warn(f"'{path}' was held by process {pid} on this host, which has ended (a run that was "
                          f"stopped mid-save?): taken over", SatPatchesWarning, stacklevel=2)
            _remove_if(path, holder)
            continue
        raise SaveLockError(
            f"another run is saving into '{folder}' (process {pid} on host {host}, '{path}'): give this run its "
            f"own --save folder; if that run has ended, delete '{path}'")
    raise SaveLockError(f"could not take '{path}' (other runs keep taking it): give this run its own --save folder")


def _remove_if(path: str, holder: Dict) -> None:
    if _read(path) == holder:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def release(folder: str, token: str) -> None:
    """Give ``folder``'s save lock back, if this process (``token``) holds it."""
    path = os.path.join(folder, LOCK_NAME)
    holder = _read(path)
    if holder and holder.get("token") == token:
        _remove_if(path, holder)
