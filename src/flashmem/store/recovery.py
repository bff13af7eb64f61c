"""Rebuild a disk store's index from its folder (see `flashmem.store.format`).

The commit log is read entry by entry. Entries after the last intact one are a
torn tail (a crash mid-append): they are cut off, the only bytes recovery ever
removes. A damaged entry *before* an intact one cannot come from a crash, so it
is corruption: reported as one line naming the file and offset, the entries
around it are kept, and its record is recovered from the segment when the
records between its intact neighbours can be walked and verified.
"""

from __future__ import annotations

import os
import re
import stat
import warnings
from dataclasses import dataclass, field

import torch

from flashmem.store.base import BlockKey
from flashmem.store.codecs import DTYPES_BY_CODE, Codec
from flashmem.store.disk_core import Loc
from flashmem.store.disk_io import pread_into, store_error
from flashmem.store.format import (
    COMMIT_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    CommitEntry,
    segment_name,
    unpack_commit,
    unpack_header,
    xxh64,
)
from flashmem.store.meta import read_meta
from flashmem.store.private_fs import open_private, open_read


class CorruptionWarning(UserWarning):
    """A store folder held damaged bytes that a crash cannot explain; the message says where."""


@dataclass
class Recovered:
    codec: Codec
    dtype: torch.dtype
    index: dict[BlockKey, Loc]
    log_length: int  # bytes of the log that are kept (a torn tail is cut off)
    next_segment: int
    report: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # one line each: corruption found


def recover(folder: str, *, verify: bool = False) -> Recovered:
    _, codec, dtype = read_meta(folder, (FORMAT_VERSION,))
    log_path = os.path.join(folder, "commit.log")
    log = _read_log(log_path)
    problems: list[str] = []
    sizes = _segment_sizes(folder, problems)
    parsed = [
        unpack_commit(memoryview(log)[i : i + COMMIT_SIZE]) for i in range(0, len(log) - COMMIT_SIZE + 1, COMMIT_SIZE)
    ]
    last = max((i for i, e in enumerate(parsed) if e is not None), default=-1)
    keep = (last + 1) * COMMIT_SIZE  # everything after the last intact entry is a torn tail
    index, counts = _replay(folder, log_path, parsed[: last + 1], codec.code, sizes, verify, problems)
    torn = len(log) - keep
    if torn:
        fd = open_private(log_path, os.O_RDWR)  # later entries must follow the last intact one
        try:
            os.ftruncate(fd, keep)
        finally:
            os.close(fd)
    for p in problems:
        warnings.warn(p, CorruptionWarning, stacklevel=3)
    return Recovered(
        codec,
        dtype,
        index,
        keep,
        max(sizes, default=-1) + 1,
        {
            "kept": counts["kept"],
            "dropped": counts["dropped"],
            "torn_log_bytes": torn,
            "corrupt_log_entries": counts["corrupt"],
            "recovered_from_segments": counts["rescued"],
        },
        problems,
    )


def _read_log(log_path: str) -> bytes:
    """The commit log's bytes (none when it does not exist)."""
    try:
        with os.fdopen(open_read(log_path), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise store_error(log_path, "cannot read the commit log", exc) from None


def _segment_sizes(folder: str, problems: list[str]) -> dict[int, int]:
    """Bytes of each segment file by number; a segment that is not a regular file is left out (and named in `problems`)."""
    sizes: dict[int, int] = {}
    for name in os.listdir(folder):
        m = re.fullmatch(r"seg-(\d{6})\.dat", name)
        if m:
            st = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(st.st_mode):
                sizes[int(m.group(1))] = st.st_size
            else:  # a planted link is never read: its entries are dropped
                problems.append(f"cold store {folder}: {name} is not a regular file; its blocks are dropped")
    return sizes


def _replay(
    folder: str,
    log_path: str,
    parsed: list[CommitEntry | None],
    code: int,
    sizes: dict[int, int],
    verify: bool,
    problems: list[str],
) -> tuple[dict[BlockKey, Loc], dict[str, int]]:
    """The index the commit entries (up to the last intact one) describe, and how many were
    kept, dropped, corrupt, and rescued from the segments; corruption is added to `problems`."""
    index: dict[BlockKey, Loc] = {}
    n = dict.fromkeys(("kept", "dropped", "corrupt", "rescued"), 0)
    prev: CommitEntry | None = None
    i = 0
    while i < len(parsed):
        e = parsed[i]
        if e is None:  # damaged entries i..j-1 between intact neighbours: corruption, not a crash
            j = i
            while parsed[j] is None:
                j += 1
            bridged = _bridge(folder, prev, parsed[j], j - i, code, sizes)  # type: ignore[arg-type]
            n["corrupt"] += j - i
            what = f"recovered {len(bridged)} block(s) from the segment" if bridged else "their blocks are lost"
            problems.append(
                f"cold store {log_path}: {j - i} damaged commit entr{'y' if j - i == 1 else 'ies'} at offset "
                f"{i * COMMIT_SIZE} (before intact ones, so not a torn tail: the file was modified or damaged); "
                f"{what}; the intact entries are kept"
            )
            for b in bridged or []:
                index[(b.layer, b.block)] = Loc(b, *_shape_dtype(folder, b))
                n["rescued"] += 1
                prev = b
            i = j
            continue
        i += 1
        if e.offset + e.record_len > sizes.get(e.segment, -1):
            n["dropped"] += 1
            continue
        shape, dt, ok = _check_record(folder, e, verify, code)
        if not ok:
            n["dropped"] += 1
            continue
        index[(e.layer, e.block)] = Loc(e, shape, dt)
        n["kept"] += 1
        prev = e
    return index, n


def _read_record(folder: str, seg: int, off: int, want_payload: bool):
    """(header or None, payload bytes or None) of the record at (seg, off)."""
    try:
        fd = open_read(os.path.join(folder, segment_name(seg)))
    except OSError:
        return None, None
    try:
        hdr = bytearray(HEADER_SIZE)
        if pread_into(fd, [hdr], off) < HEADER_SIZE:
            return None, None
        h = unpack_header(hdr)
        if h is None or not want_payload:
            return h, None
        payload = bytearray(h.payload_len)
        if pread_into(fd, [payload], off + HEADER_SIZE) < h.payload_len:
            return None, None
        return h, payload
    finally:
        os.close(fd)


def _bridge(
    folder, prev: CommitEntry | None, nxt: CommitEntry, count: int, codec_code: int, sizes
) -> list[CommitEntry] | None:
    """The `count` records written between `prev` and `nxt`, verified, or None when the walk
    does not land exactly on `nxt` (then nothing is guessed)."""
    seg, off = (prev.segment, prev.offset + prev.record_len) if prev is not None else (nxt.segment, 0)
    out: list[CommitEntry] = []
    for _ in range(count):
        h, payload = _read_record(folder, seg, off, True)
        if h is None and off > 0 and seg + 1 in sizes:  # the writer rolled to the next segment
            seg, off = seg + 1, 0
            h, payload = _read_record(folder, seg, off, True)
        if h is None or h.codec != codec_code or h.dtype not in DTYPES_BY_CODE or xxh64(payload) != h.payload_sum:
            return None
        out.append(CommitEntry(seg, h.layer, h.block, off, h.payload_len, h.payload_sum))
        off += HEADER_SIZE + h.payload_len
    if (seg, off) == (nxt.segment, nxt.offset) or (nxt.offset == 0 and nxt.segment == seg + 1):
        return out
    return None


def _shape_dtype(folder: str, e: CommitEntry):
    h, _ = _read_record(folder, e.segment, e.offset, False)
    return h.shape, DTYPES_BY_CODE[h.dtype]


def _check_record(folder: str, e, verify: bool, codec_code: int):
    try:
        fd = open_read(os.path.join(folder, segment_name(e.segment)))
    except OSError:
        return None, None, False
    try:
        hdr = bytearray(HEADER_SIZE)
        bufs: list = [hdr]
        payload = bytearray(e.payload_len) if verify else None
        if payload is not None:
            bufs.append(payload)
        got = pread_into(fd, bufs, e.offset)
    finally:
        os.close(fd)
    h = unpack_header(hdr)
    if got < sum(len(b) for b in bufs) or h is None or (h.layer, h.block) != (e.layer, e.block):
        return None, None, False
    if (
        h.payload_len != e.payload_len
        or h.payload_sum != e.payload_sum
        or h.dtype not in DTYPES_BY_CODE
        or h.codec != codec_code
    ):
        return None, None, False
    if payload is not None and xxh64(payload) != e.payload_sum:
        return None, None, False
    return h.shape, DTYPES_BY_CODE[h.dtype], True
