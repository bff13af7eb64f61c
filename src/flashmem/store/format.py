"""On-disk layout of a disk cold-tier folder (little-endian throughout).

    <cold_dir>/<name>-<pid>-<uuid>/
        meta.json          codec, dtype, format version (written to a temp file, then renamed)
        seg-000000.dat     append-only block records: header (64 B) | payload
        commit.log         append-only commit entries (64 B each), one per durable record

A record is committed once its commit entry is in commit.log; the writer
appends entries only after the records they name are written (and fdatasync'd
when sync is on). Recovery reads commit.log up to the first incomplete or
garbled entry and keeps every entry whose record lies inside its segment file.
Both structures end with an xxh64 of their own preceding bytes; the record
header and the commit entry both carry the payload's xxh64.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

FORMAT_VERSION = 1
RECORD_MAGIC = b"FMB1"
COMMIT_MAGIC = b"FMC1"
# magic, version, codec, dtype, layer, block, shape[4], payload_len, payload_xxh64, pad
_HEADER = struct.Struct("<4sHBBiq4IQQ4x")
# magic, segment, layer, pad, block, offset, payload_len, payload_xxh64, pad
_COMMIT = struct.Struct("<4sIiIqQQQ8x")
_SUM = struct.Struct("<Q")
HEADER_SIZE = _HEADER.size + _SUM.size  # 64
COMMIT_SIZE = _COMMIT.size + _SUM.size  # 64


def xxh64(buf) -> int:
    return xxhash.xxh64_intdigest(buf)


@dataclass(frozen=True)
class RecordHeader:
    codec: int
    dtype: int
    layer: int
    block: int
    shape: tuple[int, int, int, int]
    payload_len: int
    payload_sum: int


@dataclass(frozen=True)
class CommitEntry:
    segment: int
    layer: int
    block: int
    offset: int  # of the record header in the segment file
    payload_len: int
    payload_sum: int

    @property
    def record_len(self) -> int:
        return HEADER_SIZE + self.payload_len


def pack_header(h: RecordHeader) -> bytes:
    body = _HEADER.pack(
        RECORD_MAGIC, FORMAT_VERSION, h.codec, h.dtype, h.layer, h.block, *h.shape, h.payload_len, h.payload_sum
    )
    return body + _SUM.pack(xxh64(body))


def unpack_header(buf: bytes | bytearray | memoryview) -> RecordHeader | None:
    """None when the bytes are not an intact header."""
    if len(buf) < HEADER_SIZE:
        return None
    body = bytes(buf[: _HEADER.size])
    if _SUM.unpack_from(buf, _HEADER.size)[0] != xxh64(body):
        return None
    magic, ver, codec, dtype, layer, block, s0, s1, s2, s3, n, psum = _HEADER.unpack(body)
    if magic != RECORD_MAGIC or ver != FORMAT_VERSION:
        return None
    return RecordHeader(codec, dtype, layer, block, (s0, s1, s2, s3), n, psum)


def pack_commit(e: CommitEntry) -> bytes:
    body = _COMMIT.pack(COMMIT_MAGIC, e.segment, e.layer, 0, e.block, e.offset, e.payload_len, e.payload_sum)
    return body + _SUM.pack(xxh64(body))


def unpack_commit(buf: bytes | memoryview) -> CommitEntry | None:
    if len(buf) < COMMIT_SIZE:
        return None
    body = bytes(buf[: _COMMIT.size])
    if _SUM.unpack_from(buf, _COMMIT.size)[0] != xxh64(body):
        return None
    magic, seg, layer, _, block, off, n, psum = _COMMIT.unpack(body)
    if magic != COMMIT_MAGIC:
        return None
    return CommitEntry(seg, layer, block, off, n, psum)


def segment_name(i: int) -> str:
    return f"seg-{i:06d}.dat"
