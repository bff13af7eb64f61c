"""Disk helpers shared by the cold-tier benchmarks: drop a file's page cache and
measure the raw sequential read bandwidth of the disk in the same run."""

from __future__ import annotations

import os
import time


def drop_file(path: str) -> None:
    """Write back and evict one file from the page cache (fsync + fadvise DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_segments(folder: str) -> None:
    """Evict a store's data files (disk segments, LMDB's data.mdb), so the next reads come
    from the device. Pages an open LMDB environment has touched stay mapped and resident:
    reopen it after dropping to measure it cold."""
    for name in os.listdir(folder):
        if name.startswith("seg-") or name == "data.mdb":
            drop_file(os.path.join(folder, name))


def raw_sequential(folder: str, nbytes: int, chunk: int = 4 * 2**20) -> float:
    """Bytes/s reading a fresh file front to back after dropping its page cache."""
    path = os.path.join(folder, f"raw-{os.getpid()}.bin")
    buf = os.urandom(chunk)
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // chunk)):
            f.write(buf)
    drop_file(path)
    fd = os.open(path, os.O_RDONLY)
    out = bytearray(chunk)
    t0 = time.perf_counter()
    off = 0
    while (n := os.preadv(fd, [out], off)) > 0:
        off += n
    dt = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    return off / dt
