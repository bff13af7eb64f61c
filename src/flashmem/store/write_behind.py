"""What the on-disk cold tiers share: the write-behind writer, the store folder, the API.

`DiskStore` (segment files and a commit log) and `LmdbStore` (one LMDB file)
differ only in how a batch of blocks reaches the disk and how one comes back.
Everything around that lives here, once:

- `WriteBehindCore`: coded payloads (uint8 [n] host tensors) wait in `pending`
  until a background thread has made them durable, batch by batch; `read` serves
  them from memory until then, so a failing write never loses a block. A write
  error stops the writer and is kept in `error`; the facade raises it once, on the
  next put or flush. The core holds no reference to the facade, so
  `weakref.finalize` on the facade can close it when the store is dropped.
  A backend subclasses it with `_write_batch`, `_committed`, `_locate`,
  `_read_stored` and `_release`.
- `new_folder` / `open_folder`: `<cold_dir>/<name>-<pid>-<uuid>` created 0700 and
  locked (one writer per folder), or an existing folder checked and locked, with
  the lock released and a one-line `ColdStoreError` if the backend cannot start.
- `OnDiskStore`: the `ColdStore` API both facades expose.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import torch

from flashmem.errors import ColdStoreError
from flashmem.store.base import BlockKey, ColdStore, StoreStats
from flashmem.store.block_table import BlockSizes
from flashmem.store.codecs import DTYPE_CODES, Codec, get_codec
from flashmem.store.codecs.base import Shape, check_pair
from flashmem.store.disk_io import describe, store_error
from flashmem.store.format import HEADER_SIZE
from flashmem.store.locking import lock_folder, unlock
from flashmem.store.private_fs import check_own_folder, make_private_dir, make_private_dirs
from flashmem.store.transfer import decode_on, ensure_host

BATCH_BLOCKS = 64  # a write batch: at most this many blocks ...
BATCH_BYTES = 64 * 2**20  # ... or about this many payload bytes
FOLDER_HINT = "allowed: cold_dir a writable folder (created if missing)"
MAX_PENDING_BYTES = 256 * 2**20  # puts wait while more than this many bytes are not durable yet


@dataclass(frozen=True)
class WriteOptions:
    persist: bool  # keep the folder on close (and drain the queue first)
    sync: bool  # fsync every batch (and what names it) before it counts as durable
    max_pending_bytes: int = MAX_PENDING_BYTES


@dataclass(eq=False)
class Pending:
    key: BlockKey
    payload: torch.Tensor  # uint8 [n], host
    shape: Shape
    dtype: torch.dtype
    # the payload's unit checksums (store/page_sums.py), where the backend reads single pages
    page_sums: Any = None


class WriteBehindCore:
    """A store's state and its background writer; see the module docstring."""

    thread_prefix = "flashmem-writer"
    write_errors: tuple[type[BaseException], ...] = (OSError,)  # what a failed batch raises

    def __init__(self, folder: str, codec: Codec, opts: WriteOptions, lock_fd: int) -> None:
        self.folder = folder
        self.codec = codec
        self.persist = opts.persist
        self.sync = opts.sync
        self.max_pending_bytes = opts.max_pending_bytes
        self.lock_fd = lock_fd  # held for the store's life: one writer per folder
        self.leftover: str | None = None  # what close() could not remove, one line
        self.stats = StoreStats()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        # every block the store holds -> payload bytes (numpy columns, not a dict entry a block)
        self.sizes = BlockSizes()
        self.total_bytes = 0
        self.pending: dict[BlockKey, Pending] = {}
        self.pending_bytes = 0
        self.queue: deque[Pending] = deque()
        self.in_write = 0
        self.error: ColdStoreError | None = None
        self.error_reported = False
        self.closed = False
        self.stopping = False
        self.deferred_close = False
        self.thread: threading.Thread | None = None

    def start(self, sizes: dict[BlockKey, int]) -> None:
        """Start the writer, the store holding `sizes` (key -> payload bytes) already."""
        self.sizes = BlockSizes(sizes)
        self.total_bytes = self.sizes.total()
        name = f"{self.thread_prefix}-{os.path.basename(self.folder)}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- backend hooks
    def _write_batch(self, batch: list[Pending]) -> Sequence[object]:
        """Make the batch durable (writer thread, no lock held); one result per item."""
        raise NotImplementedError

    def _committed(self, item: Pending, result: object) -> None:
        """Record a durable item (lock held); `result` is its `_write_batch` result."""

    def _error_path(self) -> str:
        """The path a write error names."""
        return self.folder

    def _locate(self, key: BlockKey) -> object:
        """Where a durable block is (lock held); KeyError when the store lacks it."""
        return None

    def _read_stored(self, key: BlockKey, where: object) -> tuple[torch.Tensor, Shape, torch.dtype, float]:
        """(payload uint8 [n] host, shape, dtype, seconds reading) of a durable block,
        checksum verified (no lock held); ChecksumError on damaged bytes."""
        raise NotImplementedError

    def _release(self) -> None:
        """Close the backend's files (after the writer stopped)."""

    # ------------------------------------------------------------- writing
    def enqueue(self, item: Pending) -> None:
        """Queue a coded block; waits while too many bytes are pending (unless the writer failed)."""
        with self.cond:
            if self.closed:
                raise ColdStoreError(f"cold store {self.folder}: put after close; allowed: a new store")
            while self.error is None and self.pending_bytes > self.max_pending_bytes and not self.stopping:
                self.cond.wait()
            old = self.pending.pop(item.key, None)
            if old is not None:
                self.pending_bytes -= old.payload.numel()
            self.pending[item.key] = item
            n = item.payload.numel()
            self.pending_bytes += n
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

    def _next_batch(self) -> list[Pending]:
        """The next batch to write (empty: stop); takes the lock."""
        with self.cond:
            while not self.queue and not self.stopping:
                self.cond.wait()
            batch: list[Pending] = []
            size = 0
            while self.queue and len(batch) < BATCH_BLOCKS and size < BATCH_BYTES:
                batch.append(self.queue.popleft())
                size += batch[-1].payload.numel()
            self.in_write = len(batch)
            return batch

    def _loop(self) -> None:
        # one batch a call: its payloads are not held while the writer waits for the next (a
        # loop variable held the last batch, up to BATCH_BLOCKS blocks, 64 of SmolLM2's at 8K
        # being 6.3 MB, 0.14x its 1/8 budget, through the decode steps after the prompt)
        while self._write_next():
            pass

    def _write_next(self) -> bool:
        """Write the next batch and commit it -> False when there is none (stop) or it failed."""
        batch = self._next_batch()
        if not batch:
            return False
        try:
            t0 = time.perf_counter()
            results = self._write_batch(batch)
            dt = time.perf_counter() - t0
        except self.write_errors as exc:
            with self.cond:
                self.error = store_error(
                    self._error_path(),
                    "background write failed",
                    exc,
                    f"{len(self.pending)} blocks not yet written stay readable in memory",
                )
                self.queue.clear()
                self.in_write = 0
                self.cond.notify_all()
            return False
        with self.cond:
            for item, result in zip(batch, results):
                self._committed(item, result)
                if self.pending.get(item.key) is item:
                    del self.pending[item.key]
                    self.pending_bytes -= item.payload.numel()
                self.stats.bytes_written += HEADER_SIZE + item.payload.numel()
            del item  # the payloads go before a flush waiting on in_write can return
            batch.clear()
            self.stats.extra["write_batches"] = self.stats.extra.get("write_batches", 0) + 1
            self.stats.extra["write_s"] = self.stats.extra.get("write_s", 0.0) + dt
            self.in_write = 0
            self.cond.notify_all()
        return True

    # ------------------------------------------------------------- reading
    def read(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        """(payload uint8 [n] host, shape, dtype, shared): shared payloads must not be modified."""
        with self.lock:
            if self.closed:
                raise ColdStoreError(f"cold store {self.folder}: get after close; allowed: a new store")
            item = self.pending.get(key)
            if item is not None:
                self.stats.gets += 1
                self.stats.extra["pending_hits"] = self.stats.extra.get("pending_hits", 0) + 1
                return item.payload, item.shape, item.dtype, True
            where = self._locate(key)
        payload, shape, dtype, dt = self._read_stored(key, where)
        with self.lock:
            self.stats.gets += 1
            self.stats.bytes_read += HEADER_SIZE + payload.numel()
            self.stats.extra["read_s"] = self.stats.extra.get("read_s", 0.0) + dt
        return payload, shape, dtype, False

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
        if self.thread is not None:
            self.thread.join()
        self._finish_close()

    def _finish_close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.pending.clear()
            self.pending_bytes = 0
            self.sizes.clear()
            self.total_bytes = 0
        self._release()
        if not self.persist:
            self.leftover = remove_folder(self.folder)
        unlock(self.lock_fd)
        self.lock_fd = -1


# ------------------------------------------------------------------ folders
Core = TypeVar("Core", bound=WriteBehindCore)


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} is not allowed; allowed: {', '.join(map(str, DTYPE_CODES))}")
    return dtype


def new_folder(
    cold_dir: str, name: str | None, start: Callable[[str, int], Core], errors: tuple[type[BaseException], ...]
) -> Core:
    """Create `<cold_dir>/<name>-<pid>-<uuid>` (0700, cold_dir created if missing), lock it,
    and `start(folder, lock_fd)` the backend there. If that raises, the folder is removed
    and the lock released; one of `errors` becomes a one-line ColdStoreError."""
    stem = re.sub(r"[^A-Za-z0-9_.]+", "_", name or "store")[:40]
    folder = os.path.join(os.path.abspath(cold_dir), f"{stem}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        make_private_dirs(cold_dir)
        make_private_dir(folder)
    except OSError as exc:
        raise store_error(str(cold_dir), "cannot create the store folder", exc, FOLDER_HINT) from None
    lock = lock_folder(folder)
    try:
        return start(folder, lock)
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)
        unlock(lock)
        if isinstance(exc, errors):
            raise store_error(folder, "cannot write the store folder", exc, FOLDER_HINT) from None
        raise


def open_folder(path: str, start: Callable[[str, int], Core], errors: tuple[type[BaseException], ...]) -> Core:
    """Check that `path` is a real folder this user owns, lock it, and `start(path, lock_fd)`
    the backend there; if that raises, the lock is released and one of `errors` becomes
    a one-line ColdStoreError. Nothing is removed."""
    check_own_folder(path)
    lock = lock_folder(path)
    try:
        return start(path, lock)
    except BaseException as exc:
        unlock(lock)
        if isinstance(exc, errors):
            raise store_error(path, "cannot reopen", exc) from None
        raise


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


# ------------------------------------------------------------------ the facade
class OnDiskStore(ColdStore):
    """The ColdStore API over a WriteBehindCore. A backend subclass says how its core
    starts in a new folder (`_create`) and in a persisted one (`_reopen`); `backend`
    keywords (DiskStore: segment_bytes; LmdbStore: map_size) go to those."""

    coded_reads = True
    open_errors: tuple[type[BaseException], ...] = (OSError,)  # what a backend's start raises
    dtype: torch.dtype
    recovered: dict[str, int]  # set by reopen: kept, dropped, ...
    problems: list[str]  # set by reopen: one line per corruption found (also warned)
    _core: WriteBehindCore

    def __init__(
        self,
        cold_dir: str,
        *,
        codec: str = "exact",
        dtype: torch.dtype = torch.float16,
        name: str | None = None,
        persist: bool = False,
        sync: bool = True,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        **backend: Any,
    ) -> None:
        """A new store in its own folder `<cold_dir>/<name>-<pid>-<uuid>` (cold_dir created
        if missing), removed on close unless persist; ColdStoreError (one line) when
        cold_dir cannot be used. sync=False skips fsync (faster, not crash-safe)."""
        self.codec = get_codec(codec)
        self.dtype = check_dtype(dtype)
        opts = WriteOptions(persist, sync, max_pending_bytes)
        self._attach(
            new_folder(cold_dir, name, lambda f, lock: self._create(f, lock, opts, **backend), self.open_errors)
        )

    @classmethod
    def reopen(
        cls,
        path: str,
        *,
        persist: bool = True,
        verify: bool = False,
        sync: bool = True,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        **backend: Any,
    ) -> Self:
        """Open a persisted store folder (see the backend's `_reopen` for what is checked
        and kept). The folder must be a real folder owned by this user and not open
        elsewhere (ColdStoreError otherwise). verify=True reads every block now."""
        self = cls.__new__(cls)
        opts = WriteOptions(persist, sync, max_pending_bytes)
        path = os.path.abspath(path)
        self._attach(open_folder(path, lambda p, lock: self._reopen(p, lock, opts, verify, **backend), cls.open_errors))
        self._reopened(verify)
        return self

    def _create(self, *args: Any, **kwargs: Any) -> WriteBehindCore:
        """(folder, lock_fd, opts, **backend): start the backend in a new, empty folder
        (self.codec and self.dtype are set)."""
        raise NotImplementedError

    def _reopen(self, *args: Any, **kwargs: Any) -> WriteBehindCore:
        """(path, lock_fd, opts, verify, **backend): start the backend on a persisted folder;
        sets self.codec, dtype, recovered, problems."""
        raise NotImplementedError

    def _reopened(self, verify: bool) -> None:
        """After reopen attached the core."""

    def _attach(self, core: WriteBehindCore) -> None:
        self._core = core
        self.stats: StoreStats = core.stats
        self._finalizer = weakref.finalize(self, _close_unattended, core)

    @property
    def path(self) -> str:
        """The store's own folder."""
        return self._core.folder

    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue the block for writing; raises a pending background-write error once
        (after keeping this block in memory: nothing is lost)."""
        shape = check_pair(k, v)
        payload = ensure_host(self.codec.encode(k.detach(), v.detach()))  # uint8 [n] host
        self.put_coded(key, payload, shape, k.dtype)

    def put_coded(self, key: BlockKey, payload: torch.Tensor, shape: Shape, dtype: torch.dtype) -> None:
        """payload: uint8 [n] host tensor from this store's codec (not modified afterwards)."""
        key = (int(key[0]), int(key[1]))
        self._core.enqueue(Pending(key, payload, tuple(shape), dtype))  # type: ignore[arg-type]
        core = self._core
        if core.error is not None and not core.error_reported:
            core.error_reported = True
            raise ColdStoreError(str(core.error))

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        payload, shape, dtype, shared = self._core.read(key)
        return decode_on(self.codec, payload, shape, dtype, device, shared)

    def get_coded(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        """(payload uint8 [n] host, shape, dtype, shared); raises ChecksumError on damaged bytes."""
        return self._core.read(key)

    def __contains__(self, key: object) -> bool:
        return key in self._core.sizes

    def keys(self) -> list[BlockKey]:
        with self._core.lock:
            return list(self._core.sizes)

    def __len__(self) -> int:
        return len(self._core.sizes)

    def nbytes(self) -> int:
        return self._core.total_bytes

    def pending_blocks(self) -> int:
        """Blocks held in memory because their write is not durable yet."""
        return len(self._core.pending)

    def flush(self) -> None:
        """Wait until every put so far is durable; ColdStoreError if a write failed
        (the unwritten blocks stay readable from memory)."""
        core = self._core
        core.wait_durable()
        if core.error is not None and core.pending:
            core.error_reported = True
            raise ColdStoreError(str(core.error))

    def close(self) -> None:
        """Persisting stores drain their writes first; otherwise the folder is removed.
        ColdStoreError (one line) naming what could not be removed, if anything."""
        try:
            if self._core.persist and not self._core.closed:
                self.flush()
        finally:
            self._finalizer.detach()
            self._core.close()
        leftover, self._core.leftover = self._core.leftover, None
        if leftover:
            raise ColdStoreError(leftover)


def _close_unattended(core: WriteBehindCore) -> None:
    """Close run by garbage collection or at exit: nobody to raise to, so say it on stderr."""
    core.close()
    if core.leftover:
        import warnings

        warnings.warn(core.leftover, RuntimeWarning, stacklevel=1)


__all__ = [
    "BATCH_BLOCKS",
    "BATCH_BYTES",
    "OnDiskStore",
    "Pending",
    "WriteBehindCore",
    "WriteOptions",
    "check_dtype",
    "new_folder",
    "open_folder",
    "remove_folder",
]
