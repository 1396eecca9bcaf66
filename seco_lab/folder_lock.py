"""An exclusive, non-blocking lock on a folder: ``FOLDER/.lock`` held with ``fcntl.flock``.

The lock belongs to the open file description, so the kernel releases it when its process
exits, however it exits: a ``.lock`` file left by a dead process is stale and is simply
taken over (it only records the last owner's pid, for the message naming a live owner).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOCK_NAME", "FolderBusy", "hold_lock", "is_own_lock", "lock_holder", "release_lock", "locked"]

LOCK_NAME = ".lock"


class FolderBusy(RuntimeError):
    """Another live process holds the folder's lock."""


def is_own_lock(path: Path) -> bool:
    """``path`` is a lock file this module writes (empty, or a pid): a user's ``.lock`` holding anything else is
    the user's file, never truncated."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 32:
            return False
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return text == "" or text.isdigit()


def hold_lock(folder: Path, user: str, hint: str):
    """Take the lock of ``folder`` (an existing folder); return the open lock file, to pass to
    :func:`release_lock`.  Raises :class:`FolderBusy` naming the owner's pid when it is held."""
    path = Path(folder) / LOCK_NAME
    if (path.exists() or path.is_symlink()) and not is_own_lock(path):
        raise FolderBusy(f"{path} is not a seco-lab lock file (it holds other data): it is left alone; move it "
                         "away, or choose another folder")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        raise FolderBusy(f"{folder} is in use by another {user} (pid {owner}); {hint}") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def lock_holder(folder: Path) -> str | None:
    """The pid (as written) of a live process holding the lock of ``folder``, or None when no one holds it; asks
    with a shared, non-blocking lock on the existing lock file (nothing is created or written)."""
    path = Path(folder) / LOCK_NAME
    if path.is_symlink() or not path.is_file():
        return None
    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return f.read().strip() or "unknown"
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return None
    return None


def release_lock(f) -> None:
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


@contextmanager
def locked(folder: Path, user: str, hint: str):
    """``with locked(folder, 'bias-study', 'wait for it or pass another --out'):`` ..."""
    f = hold_lock(folder, user, hint)
    try:
        yield
    finally:
        release_lock(f)
