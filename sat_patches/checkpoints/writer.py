"""Writing SAT checkpoint directories so that a crash never leaves a half-written one in place: written into a
temporary sibling (:func:`staging_dir_for`), every file fsynced, put in place by one rename (:func:`replace_dir`);
single files are replaced the same way (:func:`write_text_atomic`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from typing import Iterator, Mapping, Optional

import torch

from .files import find_checkpoint


def fsync_dir(path: str) -> None:
    """Make a directory's entries (files created, renamed or removed in it) durable. A failure is an
    error (the entries may not be on disk), except on file systems that cannot fsync a directory."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root``, then every directory, deepest first (symlinks are not followed)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def open_exclusive(path: str):
    """A new temporary file next to ``path`` (``<path>.tmp-<pid>-<random>``), created exclusively: an
    existing file or a planted symlink at that name is never written through. Returns (name, binary file)."""
    for _ in range(100):
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        return tmp, os.fdopen(fd, "wb")
    raise FileExistsError(f"no free temporary name next to '{path}'")


def _write_atomic(path: str, write) -> None:
    tmp, f = open_exclusive(path)
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old content or the new, never a part."""
    _write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def save_atomic(obj, path: str) -> None:
    """``torch.save(obj, path)`` through a temporary file renamed into place (several writers of the
    same file, e.g. data-parallel ranks holding the same shard, cannot mix their bytes)."""
    _write_atomic(path, lambda f: torch.save(obj, f))


def replace_dir(staged: str, final: str) -> None:
    """Put the complete directory ``staged`` at ``final`` (a sibling path) with one rename, after
    fsyncing everything in it; an existing ``final`` is renamed aside for the moment of the rename (a crash
    there leaves it at ``<final>.old-<pid>``, never a partial one at ``final``) and removed only after the
    new one is in place."""
    fsync_tree(staged)
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(staged, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def staging_dir_for(final: str, shared: bool = False) -> str:
    """The temporary sibling a new ``final`` is written in: ``.<name>.partial-<pid>``, or with
    ``shared`` (several processes writing one directory) ``.<name>.partial``."""
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}.partial" + ("" if shared else f"-{os.getpid()}"))


def write_layout(directory: str, iteration: int, shards: Mapping[int, dict], config: Optional[dict] = None,
                 latest: bool = True) -> None:
    """Write SAT's checkpoint files into ``directory``: ``<iteration>/mp_rank_XX_model_states.pt`` for
    each ``{model-parallel rank: saved dict}`` of ``shards``, ``model_config.json`` (when ``config``)
    and ``latest``. Each file is replaced whole; publish the directory with :func:`replace_dir`."""
    folder = os.path.join(directory, str(iteration))
    os.makedirs(folder, exist_ok=True)
    for rank, saved in shards.items():
        save_atomic(saved, os.path.join(folder, f"mp_rank_{rank:02d}_model_states.pt"))
    if config is not None:
        write_text_atomic(os.path.join(directory, "model_config.json"), json.dumps(config, indent=4))
    if latest:
        write_text_atomic(os.path.join(directory, "latest"), str(iteration))


def publish_checkpoint_dir(staged: str, final: str) -> None:
    """:func:`replace_dir` once ``staged`` holds a complete checkpoint (every model-parallel shard of
    the iteration ``latest`` names, none truncated); else :class:`CheckpointError`, ``final`` untouched."""
    find_checkpoint(staged)
    replace_dir(staged, final)


@contextlib.contextmanager
def new_dir(final: str, publish=replace_dir) -> Iterator[str]:
    """``with new_dir(final) as tmp:`` fill ``tmp``; when the block ends normally ``publish(tmp, final)``
    puts it in place (:func:`publish_checkpoint_dir` for a checkpoint); on an error the staged files are
    removed and ``final`` is left as it was."""
    tmp = staging_dir_for(final)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
