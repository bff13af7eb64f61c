"""The disk cold tier's core: segment files and a commit log under the shared writer.

`WriteBehindCore` (flashmem.store.write_behind) keeps the pending blocks and runs
the background writer; this class says how a batch becomes durable (records
appended to the current segment, then their commit entries to commit.log, each
fdatasync'd when sync is on) and how a block is read back (`os.preadv` of its
record, header and xxh64 checked), or some of its pages (`read_units`: runs of a record,
each checked against the unit sums kept in RAM, store/page_sums.py). Each block's record and
sums are kept in numpy columns (store/block_table.py), not an object per block. Layout: see
`flashmem.store.format`.
"""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from flashmem.errors import ChecksumError, ColdStoreError
from flashmem.store.base import BlockKey
from flashmem.store.block_table import BlockTable
from flashmem.store.codecs import DTYPE_CODES, Codec
from flashmem.store.codecs.base import Shape
from flashmem.store.disk_io import pread_into, pwrite_all
from flashmem.store.format import (
    HEADER_SIZE,
    CommitEntry,
    RecordHeader,
    pack_commit,
    pack_header,
    segment_name,
    unpack_header,
    xxh64,
)
from flashmem.store.page_sums import SUM_ROWS_BYTES, SUM_TOKENS, payload_sums, unit_sums
from flashmem.store.private_fs import open_private, open_read
from flashmem.store.transfer import host_buffer
from flashmem.store.write_behind import Pending, WriteBehindCore, WriteOptions


@dataclass(frozen=True)
class Loc:
    entry: CommitEntry
    shape: Shape
    dtype: torch.dtype


class DiskCore(WriteBehindCore):
    def __init__(
        self,
        folder: str,
        codec: Codec,
        opts: WriteOptions,
        lock_fd: int,
        *,
        segment_bytes: int,
        index: dict[BlockKey, Loc] | None = None,
        first_segment: int = 0,
        log_offset: int = 0,
        unit_tokens: int = SUM_TOKENS,
    ) -> None:
        super().__init__(folder, codec, opts, lock_fd)
        self.unit_tokens = unit_tokens  # tokens a checksummed unit covers (store/page_sums.py)
        self.segment_bytes = segment_bytes
        # every durable record: where it lies, its layout and, for one put by this process, its
        # unit sums (a reopened record has none: read whole)
        self.table = BlockTable()
        for key, loc in (index or {}).items():
            e = loc.entry
            self.table.put(key, e.segment, e.offset, e.payload_len, e.payload_sum, (loc.shape, loc.dtype), None)
        self.read_fds: dict[int, int] = {}
        self.seg = first_segment
        self.seg_off = 0
        self.seg_fd = -1  # opened lazily by the writer
        self.log_path = os.path.join(folder, "commit.log")
        self.log_off = log_offset
        self.log_fd = open_private(self.log_path, os.O_RDWR | os.O_CREAT)
        if self.sync:
            fsync_dir(folder)
        self.start({k: loc.entry.payload_len for k, loc in (index or {}).items()})

    # ------------------------------------------------------------- writing
    def _error_path(self) -> str:
        return os.path.join(self.folder, segment_name(self.seg))

    def enqueue(self, item: Pending) -> None:
        """Queue a coded block, with its unit sums when the codec is exact (so its pages can be
        read alone); computed before the lock, from the payload as put."""
        if self.codec.name == "exact":
            item.page_sums = payload_sums(item.payload.numpy(), item.shape, item.dtype.itemsize, self.unit_tokens)
        super().enqueue(item)

    def _committed(self, item: Pending, result: object) -> None:
        assert isinstance(result, CommitEntry)
        e = result
        self.table.put(
            item.key, e.segment, e.offset, e.payload_len, e.payload_sum, (item.shape, item.dtype), item.page_sums
        )

    def _write_batch(self, batch: list[Pending]) -> list[CommitEntry]:
        entries: list[CommitEntry] = []
        touched: set[int] = set()
        for item in batch:
            n = item.payload.numel()
            if self.seg_fd < 0 or (self.seg_off > 0 and self.seg_off + HEADER_SIZE + n > self.segment_bytes):
                self._roll()
            layer, block = item.key
            psum = xxh64(item.payload.numpy())
            hdr = RecordHeader(self.codec.code, DTYPE_CODES[item.dtype], layer, block, item.shape, n, psum)
            pwrite_all(self.seg_fd, [pack_header(hdr), item.payload.numpy()], self.seg_off)
            entries.append(CommitEntry(self.seg, layer, block, self.seg_off, n, psum))
            touched.add(self.seg_fd)
            self.seg_off += HEADER_SIZE + n
        if self.sync:
            for fd in touched:
                os.fdatasync(fd)
        log = b"".join(pack_commit(e) for e in entries)
        pwrite_all(self.log_fd, [log], self.log_off)
        if self.sync:
            os.fdatasync(self.log_fd)
        self.log_off += len(log)
        return entries

    def _roll(self) -> None:
        if self.seg_fd >= 0:
            self.seg += 1
        path = os.path.join(self.folder, segment_name(self.seg))
        fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        if self.sync:
            fsync_dir(self.folder)  # the new file's name must survive a crash too
        with self.lock:
            self.read_fds[self.seg] = fd
        self.seg_fd, self.seg_off = fd, 0

    # ------------------------------------------------------------- reading
    def _locate(self, key: BlockKey) -> tuple[Loc, int]:
        t = self.table
        r = t.row(key)
        if r < 0:
            raise KeyError(key)  # not in the store
        seg = int(t.segment.data[r])
        n, psum = int(t.payload_len.data[r]), int(t.payload_sum.data[r])
        shape, dtype = t.layout(r)
        loc = Loc(CommitEntry(seg, key[0], key[1], int(t.offset.data[r]), n, psum), shape, dtype)  # type: ignore[arg-type]
        return loc, self._read_fd(seg)

    def _read_stored(self, key: BlockKey, where: object) -> tuple[torch.Tensor, Shape, torch.dtype, float]:
        loc, fd = cast(tuple[Loc, int], where)  # from _locate
        e = loc.entry
        path = os.path.join(self.folder, segment_name(e.segment))
        hdr = bytearray(HEADER_SIZE)
        payload = host_buffer(e.payload_len)
        t0 = time.perf_counter()
        got = pread_into(fd, [hdr, payload.numpy()], e.offset)
        dt = time.perf_counter() - t0
        at = f"{path}: block (layer {key[0]}, block {key[1]}) at offset {e.offset}"
        if got < e.record_len:
            raise ChecksumError(f"{at}: record truncated ({got} of {e.record_len} bytes on disk)")
        h = unpack_header(hdr)
        if h is None or (h.layer, h.block) != key or h.payload_len != e.payload_len or h.payload_sum != e.payload_sum:
            raise ChecksumError(f"{at}: record header damaged or not this block's")
        actual = xxh64(payload.numpy())
        if actual != e.payload_sum:
            raise ChecksumError(
                f"{at}: payload checksum mismatch (xxh64 stored {e.payload_sum:016x}, read {actual:016x}); "
                "the file was modified or damaged"
            )
        return payload, loc.shape, loc.dtype, dt

    def layout(self, key: BlockKey) -> tuple[Shape, torch.dtype] | None:
        """The block's shape and dtype when its pages can be read alone (`read_units`), else None
        (not in the store, a coded record, or one recovered from disk without unit sums)."""
        with self.lock:
            item = self.pending.get(key)
            if item is not None:
                return (item.shape, item.dtype) if item.page_sums is not None else None
            r = self.table.row(key)
            return self.table.layout(r) if r >= 0 and self.table.sums(r) is not None else None  # type: ignore[return-value]

    def read_units(
        self,
        keys: list[BlockKey],
        cuts: list[int],
        units: np.ndarray,
        nbytes: int,
        out: np.ndarray,
        dst: np.ndarray,
    ) -> bool:
        """Units of several blocks into `out` (uint8 [N, nbytes]): block keys[i]'s units are
        units[cuts[i]:cuts[i + 1]] (sorted unique indices into its payload's units of `nbytes`
        bytes), unit p going to out[dst[p]] (dst: distinct rows). From memory while pending, else
        read from the segment files in runs of units consecutive in the file (one `preadv` each,
        into the rows they land in), every unit checked against its sum (ChecksumError naming the
        block and offset). False where a block's `layout` is None. One call for all the blocks a
        page read touches: a decode step reads from thousands, and Python and numpy work per
        block was most of a disk tier's step (docs/results.md, stop 67)."""
        n = len(units)
        t = self.table
        files: list[tuple[int, int, int, np.ndarray] | None] = []  # per block: fd, start, row, sums
        with self.lock:
            if self.closed:
                raise ColdStoreError(f"cold store {self.folder}: get after close; allowed: a new store")
            hits = 0
            for i, key in enumerate(keys):
                item = self.pending.get(key)
                if item is not None:
                    if item.page_sums is None:
                        return False
                    c0, c1 = cuts[i], cuts[i + 1]
                    out[dst[c0:c1]] = item.payload.numpy().reshape(-1, nbytes)[units[c0:c1]]
                    hits += 1
                    files.append(None)
                    continue
                r = t.row(key)
                sums = t.sums(r) if r >= 0 else None
                if sums is None:
                    return False
                files.append((self._read_fd(int(t.segment.data[r])), int(t.offset.data[r]) + HEADER_SIZE, r, sums))
            self.stats.gets += len(keys)
            if hits:
                self.stats.extra["pending_hits"] = self.stats.extra.get("pending_hits", 0) + hits
        at_cuts = np.asarray(cuts)
        # runs of units consecutive in one block's record; within a run, where its rows in `out` break
        run = np.ones(n, dtype=bool)
        run[1:] = np.diff(units) != 1
        run[at_cuts[1:-1][at_cuts[1:-1] < n]] = True  # a block's first unit
        run_at = np.flatnonzero(run)
        run_block = np.searchsorted(at_cuts, run_at, side="right") - 1
        keep = np.array([f is not None for f in files], dtype=bool)[run_block]
        starts, ends = run_at[keep], np.append(run_at[1:], n)[keep]
        rows_break = np.zeros(n, dtype=bool)
        rows_break[1:] = np.diff(dst) != 1
        rows_break &= ~run
        inner_at = np.flatnonzero(rows_break)
        del rows_break
        inner, inner_row = inner_at.tolist(), dst[inner_at].tolist()  # sorted; their rows in `out`
        first_unit, first_row = units[starts].tolist(), dst[starts].tolist()
        t0 = time.perf_counter()
        for i0, i1, u0, r0, bi in zip(starts.tolist(), ends.tolist(), first_unit, first_row, run_block[keep].tolist()):
            f = files[bi]
            assert f is not None
            fd, start, r, _ = f
            j0, j1 = bisect.bisect_right(inner, i0), bisect.bisect_left(inner, i1)
            at, rows_at = [i0, *inner[j0:j1], i1], [r0, *inner_row[j0:j1]]
            bufs = [out[r : r + b - a] for r, a, b in zip(rows_at, at, at[1:])]
            got = pread_into(fd, bufs, start + u0 * nbytes)
            if got < (i1 - i0) * nbytes:
                raise ChecksumError(f"{self._record_at(keys[bi], r)}: record truncated")
        dt = time.perf_counter() - t0
        n_read = 0
        read_blocks = [(bi, f) for bi, f in enumerate(files) if f is not None]
        if read_blocks:
            # each read unit's sum as kept, in order of the units (blocks one after another); pos:
            # where the read units are among all (None: every block was read from the files)
            pos = None
            if len(read_blocks) < len(files):
                pos = np.concatenate([np.arange(cuts[bi], cuts[bi + 1]) for bi, _ in read_blocks])
            want = np.concatenate([f[3][units[cuts[bi] : cuts[bi + 1]]] for bi, f in read_blocks])
            rows = dst if pos is None else dst[pos]
            n_read = rows.size
            if n_read == out.shape[0]:  # every row of `out`: summed in place
                got_sums = unit_sums(out)[rows]
            else:  # rows gathered a bounded slice at a time, not the whole read copied
                step = max(1, SUM_ROWS_BYTES // nbytes)
                got_sums = np.concatenate([unit_sums(out[rows[i : i + step]]) for i in range(0, rows.size, step)])
            bad = np.flatnonzero(got_sums != want)
            if bad.size:
                p = int(bad[0]) if pos is None else int(pos[bad[0]])
                bi = int(np.searchsorted(at_cuts, p, side="right") - 1)
                f = files[bi]
                assert f is not None
                raise ChecksumError(
                    f"{self._record_at(keys[bi], f[2])}: page checksum mismatch at payload byte "
                    f"{int(units[p]) * nbytes}; the file was modified or damaged"
                )
        with self.lock:
            self.stats.bytes_read += n_read * nbytes
            self.stats.extra["read_s"] = self.stats.extra.get("read_s", 0.0) + dt
            self.stats.extra["page_reads"] = self.stats.extra.get("page_reads", 0) + len(starts)
        return True

    def _record_at(self, key: BlockKey, r: int) -> str:
        """Where row r's record lies, for an error: its segment file, block and offset."""
        seg, off = int(self.table.segment.data[r]), int(self.table.offset.data[r])
        return f"{os.path.join(self.folder, segment_name(seg))}: block (layer {key[0]}, block {key[1]}) at offset {off}"

    def _read_fd(self, seg: int) -> int:
        fd = self.read_fds.get(seg)
        if fd is None:
            fd = open_read(os.path.join(self.folder, segment_name(seg)))
            self.read_fds[seg] = fd
        return fd

    # ------------------------------------------------------------- closing
    def _release(self) -> None:
        with self.lock:
            self.table.clear()
            fds = list(self.read_fds.values()) + [self.log_fd]
            self.read_fds.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
