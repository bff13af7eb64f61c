"""Private, symlink-proof files for the on-disk cold tiers.

KV blocks encode the user's prompts, so store folders are 0700 and their files
0600 whatever the umask (the mode is set with chmod after creation, since the
umask can only remove bits). Every open refuses a symlink at the last path
component (O_NOFOLLOW), and a folder is only used when it is a real directory
owned by this user: a planted link or someone else's folder cannot redirect a
write or a truncation.
"""

from __future__ import annotations

import errno
import os
import stat

from flashmem.errors import ColdStoreError
from flashmem.store.disk_io import store_error

DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def make_private_dir(path: str) -> None:
    """Create `path` (its parent must exist) with mode 0700; FileExistsError if it exists."""
    os.mkdir(path, DIR_MODE)
    os.chmod(path, DIR_MODE)


def make_private_dirs(path: str) -> None:
    """Like `os.makedirs(path, exist_ok=True)`; the folders it creates are 0700."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        make_private_dirs(parent)
    try:
        make_private_dir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path) from None


def open_private(path: str, flags: int) -> int:
    """os.open without following a symlink; a file this call creates is 0600."""
    fd = os.open(path, flags | _NOFOLLOW, FILE_MODE)
    if flags & os.O_CREAT:
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
    return fd


def open_read(path: str) -> int:
    """A read-only descriptor of `path`, refusing a symlink (ELOOP)."""
    return os.open(path, os.O_RDONLY | _NOFOLLOW)


def check_own_folder(path: str) -> None:
    """ColdStoreError unless `path` is a real directory (not a symlink) owned by this user."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise store_error(path, "not a readable flashmem store folder", exc) from None
    if stat.S_ISLNK(st.st_mode):
        raise ColdStoreError(f"cold store {path}: is a symbolic link; allowed: the store folder itself")
    if not stat.S_ISDIR(st.st_mode):
        raise ColdStoreError(f"cold store {path}: not a folder; allowed: a flashmem store folder")
    if st.st_uid != os.geteuid():
        raise ColdStoreError(
            f"cold store {path}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
            "allowed: a store folder you own"
        )


def tighten(folder: str) -> None:
    """Make an existing store folder and its regular files private (reopen of an older folder)."""
    os.chmod(folder, DIR_MODE, follow_symlinks=False)
    for name in os.listdir(folder):
        p = os.path.join(folder, name)
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(p, FILE_MODE)
