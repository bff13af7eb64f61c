"""One writer per store folder: an exclusive `fcntl.flock` on `<folder>/lock`.

flock locks belong to an open file description, so a second open of the same
folder conflicts whether it comes from another process or from this one (two
`DiskStore`s on one folder in one process would otherwise both append to its
log and lose blocks). The lock is released when the descriptor is closed, and
by the kernel when the process dies, so a crashed writer never blocks a reopen.
"""

from __future__ import annotations

import fcntl
import os

from flashmem.errors import ColdStoreError
from flashmem.store.disk_io import store_error
from flashmem.store.private_fs import open_private

LOCK_NAME = "lock"


def lock_folder(folder: str) -> int:
    """Take the folder's writer lock without waiting; returns the descriptor that holds it."""
    path = os.path.join(folder, LOCK_NAME)
    try:
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise store_error(folder, "cannot create the lock file", exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ColdStoreError(
            f"cold store {folder}: already open by another writer (lock {path} is held); "
            "allowed: one open store per folder: close the other one first"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise store_error(folder, "cannot lock the folder", exc) from None
    return fd


def unlock(fd: int) -> None:
    """Release a lock taken by `lock_folder` (closing the descriptor releases it)."""
    try:
        os.close(fd)
    except OSError:
        pass
