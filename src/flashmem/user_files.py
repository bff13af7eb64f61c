"""Reading files a user names: regular files only, read up to a cap.

`/dev/zero`, `/dev/urandom` or a FIFO given as a config or an input would
otherwise be read until memory runs out, or block forever. The file is opened
non-blocking and checked with fstat (so a FIFO swapped in after a check cannot
hang the read), and at most `max_bytes` are read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flashmem.errors import FlashMemError

MiB = 2**20


def read_user_text(path: str | Path, what: str, max_bytes: int, error: type[FlashMemError] = FlashMemError) -> str:
    """The UTF-8 text of regular file `path`; `error` (one line, naming `what`) otherwise."""
    raw = read_user_bytes(path, what, max_bytes, error)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{what} {path}: not UTF-8 text (bad byte at offset {exc.start}); allowed: a UTF-8 text file"
        ) from None


def read_user_bytes(path: str | Path, what: str, max_bytes: int, error: type[FlashMemError] = FlashMemError) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file; allowed: an existing file") from None
    except OSError as exc:
        raise error(f"{what} {path}: cannot be opened ({exc.strerror or type(exc).__name__})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
            raise error(f"{what} {path}: is {kind}; allowed: a regular file")
        if st.st_size > max_bytes:
            raise error(f"{what} {path}: {st.st_size} bytes; allowed: at most {_size(max_bytes)}")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 4 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise error(f"{what} {path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while being read
        raise error(f"{what} {path}: larger than {_size(max_bytes)}; allowed: at most {_size(max_bytes)}")
    return data


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n} bytes"
