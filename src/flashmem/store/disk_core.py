"""The disk cold tier's state and background writer (no reference to the facade,
so `weakref.finalize` on the facade can close it when the store is dropped).

Coded payloads (uint8 [n] host tensors) wait in `pending` until the writer has
written their record and its commit entry; `read` serves them from memory until
then, so a failing write never loses a block. A write error stops the writer
and is kept in `error`; the facade raises it on the next put/flush.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from flashmem.errors import ChecksumError, ColdStoreError
from flashmem.store.base import BlockKey, StoreStats
from flashmem.store.codecs import DTYPE_CODES, Codec
from flashmem.store.codecs.base import Shape
from flashmem.store.disk_io import describe, pread_into, pwrite_all, store_error
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
from flashmem.store.locking import unlock
from flashmem.store.private_fs import open_private, open_read
from flashmem.store.transfer import host_buffer

BATCH_BLOCKS = 64
BATCH_BYTES = 64 * 2**20


@dataclass(eq=False)
class Pending:
    key: BlockKey
    payload: torch.Tensor  # uint8 [n], host
    shape: Shape
    dtype: torch.dtype


@dataclass(frozen=True)
class Loc:
    entry: CommitEntry
    shape: Shape
    dtype: torch.dtype


class DiskCore:
    def __init__(
        self,
        folder: str,
        codec: Codec,
        *,
        persist: bool,
        sync: bool,
        segment_bytes: int,
        max_pending_bytes: int,
        index: dict[BlockKey, Loc] | None = None,
        first_segment: int = 0,
        log_offset: int = 0,
        lock_fd: int = -1,
    ) -> None:
        self.folder = folder
        self.lock_fd = lock_fd  # held for the store's life: one writer per folder
        self.leftover: str | None = None  # what close() could not remove, one line
        self.codec = codec
        self.persist = persist
        self.sync = sync
        self.segment_bytes = segment_bytes
        self.max_pending_bytes = max_pending_bytes
        self.stats = StoreStats()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.index: dict[BlockKey, Loc] = dict(index or {})
        self.sizes: dict[BlockKey, int] = {k: l.entry.payload_len for k, l in self.index.items()}
        self.total_bytes = sum(self.sizes.values())
        self.pending: dict[BlockKey, Pending] = {}
        self.pending_bytes = 0
        self.queue: deque[Pending] = deque()
        self.in_write = 0
        self.error: ColdStoreError | None = None
        self.error_reported = False
        self.closed = False
        self.stopping = False
        self.deferred_close = False
        self.read_fds: dict[int, int] = {}
        self.seg = first_segment
        self.seg_off = 0
        self.seg_fd = -1  # opened lazily by the writer
        self.log_path = os.path.join(folder, "commit.log")
        self.log_off = log_offset
        self.log_fd = open_private(self.log_path, os.O_RDWR | os.O_CREAT)
        if sync:
            fsync_dir(folder)
        self.thread = threading.Thread(
            target=self._run, name=f"flashmem-writer-{os.path.basename(folder)}", daemon=True
        )
        self.thread.start()

    # ------------------------------------------------------------- writing
    def enqueue(self, item: Pending) -> None:
        """Queue a coded block; waits while too many bytes are pending (unless the writer failed)."""
        with self.cond:
            if self.closed:
                raise ColdStoreError(f"cold store {self.folder}: put after close")
            while self.error is None and self.pending_bytes > self.max_pending_bytes and not self.stopping:
                self.cond.wait()
            old = self.pending.pop(item.key, None)
            if old is not None:
                self.pending_bytes -= old.payload.numel()
            self.pending[item.key] = item
            self.pending_bytes += item.payload.numel()
            n = item.payload.numel()
            self.total_bytes += n - self.sizes.get(item.key, 0)
            self.sizes[item.key] = n
            self.stats.puts += 1
            if self.error is None:
                self.queue.append(item)
                self.cond.notify_all()

    def wait_durable(self) -> None:
        with self.cond:
            while (self.queue or self.in_write) and self.error is None:
                self.cond.wait()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self.deferred_close:  # close() ran on this thread (a GC finalizer): finish it here
                self._finish_close()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if not self.queue:
                    return
                batch: list[Pending] = []
                size = 0
                while self.queue and len(batch) < BATCH_BLOCKS and size < BATCH_BYTES:
                    batch.append(self.queue.popleft())
                    size += batch[-1].payload.numel()
                self.in_write = len(batch)
            try:
                t0 = time.perf_counter()
                entries = self._write_batch(batch)
                dt = time.perf_counter() - t0
            except OSError as exc:
                with self.cond:
                    where = os.path.join(self.folder, segment_name(self.seg))
                    self.error = store_error(
                        where,
                        "background write failed",
                        exc,
                        f"{len(self.pending)} blocks not yet written stay readable in memory",
                    )
                    self.queue.clear()
                    self.in_write = 0
                    self.cond.notify_all()
                return
            with self.cond:
                for item, entry in zip(batch, entries):
                    self.index[item.key] = Loc(entry, item.shape, item.dtype)
                    if self.pending.get(item.key) is item:
                        del self.pending[item.key]
                        self.pending_bytes -= item.payload.numel()
                    self.stats.bytes_written += entry.record_len
                self.stats.extra["write_batches"] = self.stats.extra.get("write_batches", 0) + 1
                self.stats.extra["write_s"] = self.stats.extra.get("write_s", 0.0) + dt
                self.in_write = 0
                self.cond.notify_all()

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
    def read(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        """(payload uint8 [n] host, shape, dtype, shared): shared payloads must not be modified."""
        with self.lock:
            if self.closed:
                raise ColdStoreError(f"cold store {self.folder}: get after close")
            item = self.pending.get(key)
            if item is not None:
                self.stats.gets += 1
                self.stats.extra["pending_hits"] = self.stats.extra.get("pending_hits", 0) + 1
                return item.payload, item.shape, item.dtype, True
            loc = self.index[key]  # KeyError: not in the store
            fd = self._read_fd(loc.entry.segment)
        e = loc.entry
        path = os.path.join(self.folder, segment_name(e.segment))
        hdr = bytearray(HEADER_SIZE)
        payload = host_buffer(e.payload_len)
        t0 = time.perf_counter()
        got = pread_into(fd, [hdr, payload.numpy()], e.offset)
        dt = time.perf_counter() - t0
        where = f"{path}: block (layer {key[0]}, block {key[1]}) at offset {e.offset}"
        if got < e.record_len:
            raise ChecksumError(f"{where}: record truncated ({got} of {e.record_len} bytes on disk)")
        h = unpack_header(hdr)
        if h is None or (h.layer, h.block) != key or h.payload_len != e.payload_len or h.payload_sum != e.payload_sum:
            raise ChecksumError(f"{where}: record header damaged or not this block's")
        actual = xxh64(payload.numpy())
        if actual != e.payload_sum:
            raise ChecksumError(
                f"{where}: payload checksum mismatch (xxh64 stored {e.payload_sum:016x}, read {actual:016x}); "
                "the file was modified or damaged"
            )
        with self.lock:
            self.stats.gets += 1
            self.stats.bytes_read += e.record_len
            self.stats.extra["read_s"] = self.stats.extra.get("read_s", 0.0) + dt
        return payload, loc.shape, loc.dtype, False

    def _read_fd(self, seg: int) -> int:
        fd = self.read_fds.get(seg)
        if fd is None:
            fd = open_read(os.path.join(self.folder, segment_name(seg)))
            self.read_fds[seg] = fd
        return fd

    # ------------------------------------------------------------- closing
    def close(self) -> None:
        """Stop the writer (after draining it when persisting), close files, remove the folder unless persist."""
        with self.cond:
            if self.closed or self.stopping:
                return
            if not self.persist:
                self.queue.clear()
            self.stopping = True
            self.cond.notify_all()
        if threading.current_thread() is self.thread:
            self.deferred_close = True
            return  # a finalizer run by GC on the writer thread: the writer finishes the close itself
        self.thread.join()
        self._finish_close()

    def _finish_close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.pending.clear()
            self.pending_bytes = 0
            self.index.clear()
            self.sizes.clear()
            self.total_bytes = 0
            fds = list(self.read_fds.values()) + [self.log_fd]
            self.read_fds.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if not self.persist:
            self.leftover = remove_folder(self.folder)
        unlock(self.lock_fd)
        self.lock_fd = -1


def remove_folder(folder: str) -> str | None:
    """rmtree that says what it could not remove: None, or one line for the user."""
    failed: list[str] = []

    def note(_func: object, path: str, exc: object) -> None:
        err = exc if isinstance(exc, BaseException) else exc[1]  # type: ignore[index]  # onerror: exc_info
        if not isinstance(err, FileNotFoundError):
            failed.append(f"{path}: {describe(err) if isinstance(err, OSError) else err}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=note)
    else:
        shutil.rmtree(folder, onerror=note)
    if not failed:
        return None
    return (
        f"cold store {folder}: could not remove {len(failed)} path(s) (first: {failed[0]}); "
        "the folder holds KV blocks: remove it by hand"
    )


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
