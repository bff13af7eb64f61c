"""Rebuild a disk store's index from its folder (see `flashmem.store.format`)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from flashmem.errors import ColdStoreError
from flashmem.store.base import BlockKey
from flashmem.store.codecs import DTYPES_BY_CODE, Codec, get_codec
from flashmem.store.disk_core import Loc
from flashmem.store.disk_io import pread_into, store_error
from flashmem.store.format import COMMIT_SIZE, HEADER_SIZE, segment_name, unpack_commit, unpack_header, xxh64


@dataclass
class Recovered:
    codec: Codec
    dtype: torch.dtype
    index: dict[BlockKey, Loc]
    log_length: int  # bytes of intact commit entries (the log is truncated to this)
    next_segment: int
    report: dict[str, int] = field(default_factory=dict)


def recover(folder: str, *, verify: bool = False) -> Recovered:
    try:
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        codec = get_codec(meta["codec"])
        dtype = getattr(torch, meta["dtype"])
    except OSError as exc:
        raise store_error(folder, "not a readable flashmem store folder", exc) from None
    except (ValueError, KeyError, AttributeError) as exc:
        raise ColdStoreError(f"cold store {folder}: meta.json is damaged ({exc})") from None
    log_path = os.path.join(folder, "commit.log")
    try:
        with open(log_path, "rb") as f:
            log = f.read()
    except FileNotFoundError:
        log = b""
    segs = [int(m.group(1)) for n in os.listdir(folder) if (m := re.fullmatch(r"seg-(\d{6})\.dat", n))]
    sizes = {s: os.path.getsize(os.path.join(folder, segment_name(s))) for s in segs}
    index: dict[BlockKey, Loc] = {}
    kept = dropped = 0
    pos = 0
    while pos + COMMIT_SIZE <= len(log):
        e = unpack_commit(memoryview(log)[pos : pos + COMMIT_SIZE])
        if e is None:
            break  # garbled or torn tail: nothing after it was committed in order
        pos += COMMIT_SIZE
        if e.offset + e.record_len > sizes.get(e.segment, -1):
            dropped += 1
            continue
        shape, dt, ok = _check_record(folder, e, verify, codec.code)
        if not ok:
            dropped += 1
            continue
        index[(e.layer, e.block)] = Loc(e, shape, dt)
        kept += 1
    torn = len(log) - pos
    if torn:
        with open(log_path, "r+b") as f:  # later entries must follow the last intact one
            f.truncate(pos)
    return Recovered(
        codec,
        dtype,
        index,
        pos,
        max(segs, default=-1) + 1,
        {"kept": kept, "dropped": dropped, "torn_log_bytes": torn},
    )


def _check_record(folder: str, e, verify: bool, codec_code: int):
    path = os.path.join(folder, segment_name(e.segment))
    fd = os.open(path, os.O_RDONLY)
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
