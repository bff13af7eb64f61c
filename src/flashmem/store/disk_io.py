"""Low-level file I/O of the disk cold tier: whole writes, whole reads, one-line errors."""

from __future__ import annotations

import errno
import os

from flashmem.errors import ColdStoreError


def pwrite_all(fd: int, bufs: list, offset: int) -> int:
    """Write every buffer at `offset` (retrying short writes); returns bytes written."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        offset += n
        total += n
        _advance(views, n)
    return total


def pread_into(fd: int, bufs: list, offset: int) -> int:
    """Fill the buffers from `offset`; returns bytes read (less only at end of file)."""
    views = [memoryview(b).cast("B") for b in bufs]
    want = sum(len(v) for v in views)
    total = 0
    while total < want:
        n = os.preadv(fd, views, offset + total)
        if n <= 0:
            break
        total += n
        _advance(views, n)
    return total


def _advance(views: list, n: int) -> None:
    """Drop the first n bytes from a list of memoryviews (after a short vectored I/O)."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def store_error(path: str, what: str, exc: BaseException, hint: str = "") -> ColdStoreError:
    """One line: `cold store <path>: <what>: <reason>[; <hint>]` (an OSError's reason
    names its errno; any other exception is named by its type, e.g. lmdb's errors)."""
    reason = describe(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
    msg = f"cold store {path}: {what}: {reason}"
    if hint:
        msg += f"; {hint}"
    return ColdStoreError(msg)
