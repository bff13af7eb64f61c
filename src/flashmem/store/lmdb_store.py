"""LMDB cold tier: the same contract as DiskStore on a proven embedded store.

LMDB (through the `lmdb` package) brings what the hand-written disk tier has to
build itself: crash-safe copy-on-write commits (no log to recover, no torn
tail), one writer at a time, and memory-mapped reads. Each block is one value,
`record header (64 B, flashmem.store.format) | coded payload`, under the key
(layer, block); the header's xxh64 of the payload is checked on every read,
since LMDB does not checksum data. Writes are batched into one transaction by a
background thread, as in DiskStore: a block is readable from memory at once and
stays so if a commit fails (map full, disk full), and the error is raised once.

Folder `<cold_dir>/<name>-<pid>-<uuid>/`: meta.json, lock (flashmem's one-writer
lock), data.mdb, lock.mdb; 0700/0600 like the disk tier.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
import threading
import time
import uuid
import weakref
from collections import deque

import lmdb
import torch

from flashmem.errors import ChecksumError, ColdStoreError
from flashmem.store.base import BlockKey, ColdStore, StoreStats
from flashmem.store.codecs import DTYPE_CODES, DTYPES_BY_CODE, get_codec
from flashmem.store.codecs.base import Shape, check_pair
from flashmem.store.disk import decode_on
from flashmem.store.disk_core import BATCH_BLOCKS, BATCH_BYTES, Pending, remove_folder
from flashmem.store.disk_io import store_error
from flashmem.store.format import HEADER_SIZE, RecordHeader, pack_header, unpack_header, xxh64
from flashmem.store.locking import lock_folder, unlock
from flashmem.store.meta import read_meta, write_meta
from flashmem.store.private_fs import FILE_MODE, check_own_folder, make_private_dir, make_private_dirs, tighten
from flashmem.store.transfer import ensure_host, host_buffer

FORMAT = 1
BACKEND = "lmdb"
_KEY = struct.Struct(">iq")  # big-endian: LMDB's byte order sorts keys by (layer, block)
MAP_SIZE = 2**40  # address space only: the file grows with what is written


def _key(key: BlockKey) -> bytes:
    return _KEY.pack(int(key[0]), int(key[1]))


class _Core:
    """State and writer thread (no reference to the facade, so GC can close it)."""

    def __init__(
        self,
        folder: str,
        codec,
        *,
        persist: bool,
        sync: bool,
        map_size: int,
        max_pending_bytes: int,
        lock_fd: int,
        create: bool,
    ) -> None:
        self.folder = folder
        self.codec = codec
        self.persist = persist
        self.max_pending_bytes = max_pending_bytes
        self.lock_fd = lock_fd
        self.stats = StoreStats()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.pending: dict[BlockKey, Pending] = {}
        self.pending_bytes = 0
        self.queue: deque[Pending] = deque()
        self.in_write = 0
        self.error: ColdStoreError | None = None
        self.error_reported = False
        self.closed = self.stopping = False
        self.leftover: str | None = None
        for name in ("data.mdb", "lock.mdb"):  # LMDB opens these itself: refuse planted links first
            p = os.path.join(folder, name)
            if os.path.lexists(p) and not stat.S_ISREG(os.lstat(p).st_mode):
                raise ColdStoreError(f"cold store {folder}: {name} is not a regular file; allowed: LMDB's own files")
        self.env = lmdb.open(
            folder,
            map_size=map_size,
            subdir=True,
            create=create,
            sync=sync,
            metasync=sync,
            readahead=False,
            max_readers=256,
            mode=FILE_MODE,
            lock=True,
        )
        tighten(folder)  # lmdb's mode goes through the umask
        try:
            _check_not_truncated(self.env, folder)
        except BaseException:
            self.env.close()
            raise
        self.sizes: dict[BlockKey, int] = {}
        self.problems: list[str] = []
        with self.env.begin(buffers=True) as txn:
            for k, val in txn.cursor():
                h = unpack_header(bytes(val[:HEADER_SIZE]))
                key = _KEY.unpack(bytes(k)) if len(k) == _KEY.size else None
                if h is None or key is None or (h.layer, h.block) != key or len(val) != HEADER_SIZE + h.payload_len:
                    # a damaged key or header: never served under a wrong key, reported instead
                    self.problems.append(f"cold store {folder}/data.mdb: entry {bytes(k).hex()} is damaged; dropped")
                    continue
                self.sizes[key] = h.payload_len
        self.total_bytes = sum(self.sizes.values())
        self.thread = threading.Thread(target=self._run, name=f"flashmem-lmdb-{os.path.basename(folder)}", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- writing
    def enqueue(self, item: Pending) -> None:
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
                written = self._write(batch)
            except (lmdb.Error, OSError) as exc:
                with self.cond:
                    self.error = _error(
                        self.folder,
                        "background write failed",
                        exc,
                        f"{len(self.pending)} blocks not yet written stay readable in memory",
                    )
                    self.queue.clear()
                    self.in_write = 0
                    self.cond.notify_all()
                return
            with self.cond:
                for item in batch:
                    if self.pending.get(item.key) is item:
                        del self.pending[item.key]
                        self.pending_bytes -= item.payload.numel()
                self.stats.bytes_written += written
                self.in_write = 0
                self.cond.notify_all()

    def _write(self, batch: list[Pending]) -> int:
        written = 0
        with self.env.begin(write=True) as txn:  # one commit (and fsync when sync) per batch
            for item in batch:
                pay = item.payload.numpy()
                hdr = RecordHeader(
                    self.codec.code, DTYPE_CODES[item.dtype], item.key[0], item.key[1], item.shape, pay.size, xxh64(pay)
                )
                val = pack_header(hdr) + pay.tobytes()
                txn.put(_key(item.key), val)
                written += len(val)
        return written

    # ------------------------------------------------------------- reading
    def read(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        with self.lock:
            if self.closed:
                raise ColdStoreError(f"cold store {self.folder}: get after close; allowed: a new store")
            item = self.pending.get(key)
            if item is not None:
                self.stats.gets += 1
                self.stats.extra["pending_hits"] = self.stats.extra.get("pending_hits", 0) + 1
                return item.payload, item.shape, item.dtype, True
        where = f"{os.path.join(self.folder, 'data.mdb')}: block (layer {key[0]}, block {key[1]})"
        t0 = time.perf_counter()
        try:
            with self.env.begin(buffers=True) as txn:
                val = txn.get(_key(key))
                if val is None:
                    if key in self.sizes:  # listed when opened, lost since: LMDB's tree is damaged
                        raise ChecksumError(
                            f"{where}: listed in the store but LMDB cannot find it; the file is damaged"
                        )
                    raise KeyError(key)
                h = unpack_header(bytes(val[:HEADER_SIZE]))
                if h is None or (h.layer, h.block) != tuple(key) or len(val) != HEADER_SIZE + h.payload_len:
                    raise ChecksumError(f"{where}: record header damaged or not this block's")
                payload = host_buffer(h.payload_len)
                payload.numpy()[:] = memoryview(val)[HEADER_SIZE:]  # one copy out of the map
        except lmdb.Error as exc:
            raise ChecksumError(f"{where}: LMDB cannot read it ({exc})") from None
        dt = time.perf_counter() - t0
        actual = xxh64(payload.numpy())
        if actual != h.payload_sum:
            raise ChecksumError(
                f"{where}: payload checksum mismatch (xxh64 stored {h.payload_sum:016x}, read {actual:016x}); "
                "the file was modified or damaged"
            )
        if h.dtype not in DTYPES_BY_CODE or h.codec != self.codec.code:
            raise ChecksumError(f"{where}: record of another codec or dtype")
        with self.lock:
            self.stats.gets += 1
            self.stats.bytes_read += HEADER_SIZE + h.payload_len
            self.stats.extra["read_s"] = self.stats.extra.get("read_s", 0.0) + dt  # lookup + copy from the map
        return payload, h.shape, DTYPES_BY_CODE[h.dtype], False

    # ------------------------------------------------------------- closing
    def close(self) -> None:
        with self.cond:
            if self.closed or self.stopping:
                return
            if not self.persist:
                self.queue.clear()
            self.stopping = True
            self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()
        with self.cond:
            self.closed = True
            self.pending.clear()
            self.sizes.clear()
            self.pending_bytes = self.total_bytes = 0
        self.env.close()
        if not self.persist:
            self.leftover = remove_folder(self.folder)
        unlock(self.lock_fd)


def _error(folder: str, what: str, exc: BaseException, hint: str = "") -> ColdStoreError:
    if isinstance(exc, OSError):
        return store_error(folder, what, exc, hint)
    msg = f"cold store {folder}: {what}: {type(exc).__name__}: {exc}"
    return ColdStoreError(f"{msg}; {hint}" if hint else msg)


class LmdbStore(ColdStore):
    tier = "lmdb"
    coded_reads = True
    recovered: dict[str, int]  # set by reopen: kept / dropped entries
    problems: list[str]  # set by reopen: one line per damaged entry found

    def __init__(
        self,
        cold_dir: str,
        *,
        codec: str = "exact",
        dtype: torch.dtype = torch.float16,
        name: str | None = None,
        persist: bool = False,
        sync: bool = True,
        map_size: int = MAP_SIZE,
        max_pending_bytes: int = 256 * 2**20,
    ) -> None:
        self.codec = get_codec(codec)
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype} is not allowed; allowed: {', '.join(map(str, DTYPE_CODES))}")
        self.dtype = dtype
        stem = re.sub(r"[^A-Za-z0-9_.]+", "_", name or "store")[:40]
        folder = os.path.join(os.path.abspath(cold_dir), f"{stem}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        hint = "allowed: cold_dir a writable folder (created if missing)"
        try:
            make_private_dirs(cold_dir)
            make_private_dir(folder)
        except OSError as exc:
            raise store_error(str(cold_dir), "cannot create the store folder", exc, hint) from None
        lock = lock_folder(folder)
        try:
            write_meta(folder, FORMAT, self.codec.name, dtype, persist, backend=BACKEND)
            core = _Core(
                folder,
                self.codec,
                persist=persist,
                sync=sync,
                map_size=map_size,
                max_pending_bytes=max_pending_bytes,
                lock_fd=lock,
                create=True,
            )
        except (OSError, lmdb.Error) as exc:
            shutil.rmtree(folder, ignore_errors=True)
            unlock(lock)
            raise _error(folder, "cannot write the store folder", exc, hint) from None
        self._attach(core)

    @classmethod
    def reopen(
        cls,
        path: str,
        *,
        persist: bool = True,
        verify: bool = False,
        sync: bool = True,
        map_size: int = MAP_SIZE,
        max_pending_bytes: int = 256 * 2**20,
    ) -> LmdbStore:
        """Open a persisted folder (LMDB's last committed transaction is the state; there
        is nothing to repair). verify=True reads every block and drops none: a damaged
        one raises ChecksumError here instead of on first use."""
        path = os.path.abspath(path)
        check_own_folder(path)
        lock = lock_folder(path)
        try:
            meta, codec, dtype = read_meta(path, (FORMAT,))
            if meta.get("backend") != BACKEND:
                raise ColdStoreError(
                    f"cold store {path}: meta.json backend {meta.get('backend')!r}; allowed: 'lmdb' "
                    "(open other folders with their own store)"
                )
            self = cls.__new__(cls)
            self.codec, self.dtype = codec, dtype
            write_meta(path, FORMAT, codec.name, dtype, persist, backend=BACKEND)
            core = _Core(
                path,
                codec,
                persist=persist,
                sync=sync,
                map_size=map_size,
                max_pending_bytes=max_pending_bytes,
                lock_fd=lock,
                create=False,
            )
        except (OSError, lmdb.Error) as exc:
            unlock(lock)
            raise _error(path, "cannot reopen", exc) from None
        except BaseException:
            unlock(lock)
            raise
        self._attach(core)
        self.recovered = {"kept": len(core.sizes), "dropped": len(core.problems)}
        self.problems = core.problems
        if core.problems:
            import warnings

            from flashmem.store.recovery import CorruptionWarning

            for p in core.problems:
                warnings.warn(p, CorruptionWarning, stacklevel=2)
        if verify:
            for key in list(core.sizes):
                core.read(key)
        return self

    def _attach(self, core: _Core) -> None:
        self._core = core
        self.stats: StoreStats = core.stats
        self._finalizer = weakref.finalize(self, _close_unattended, core)

    # ------------------------------------------------------------------ API
    @property
    def path(self) -> str:
        return self._core.folder

    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = check_pair(k, v)
        payload = ensure_host(self.codec.encode(k.detach(), v.detach()))
        self.put_coded(key, payload, shape, k.dtype)

    def put_coded(self, key: BlockKey, payload: torch.Tensor, shape: Shape, dtype: torch.dtype) -> None:
        key = (int(key[0]), int(key[1]))
        self._core.enqueue(Pending(key, payload, tuple(shape), dtype))  # type: ignore[arg-type]
        core = self._core
        if core.error is not None and not core.error_reported:
            core.error_reported = True
            raise core.error

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        payload, shape, dtype, shared = self._core.read(key)
        return decode_on(self.codec, payload, shape, dtype, device, shared)

    def get_coded(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
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
        return len(self._core.pending)

    def flush(self) -> None:
        core = self._core
        core.wait_durable()
        if core.error is not None and core.pending:
            core.error_reported = True
            raise ColdStoreError(str(core.error))

    def close(self) -> None:
        try:
            if self._core.persist and not self._core.closed:
                self.flush()
        finally:
            self._finalizer.detach()
            self._core.close()
        leftover, self._core.leftover = self._core.leftover, None
        if leftover:
            raise ColdStoreError(leftover)


def _check_not_truncated(env: lmdb.Environment, folder: str) -> None:
    """A data.mdb shorter than the pages its meta page names would fault (SIGBUS) once a
    read touches the missing part of the map: refuse it with one line instead. Only
    LMDB's meta pages are read here (env.info), never the map."""
    size = os.lstat(os.path.join(folder, "data.mdb")).st_size
    end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if size < end:
        raise ColdStoreError(
            f"cold store {folder}: data.mdb is truncated ({size} bytes, its last page ends at {end}); "
            "allowed: an intact LMDB store"
        )


def _close_unattended(core: _Core) -> None:
    core.close()
    if core.leftover:
        import warnings

        warnings.warn(core.leftover, RuntimeWarning, stacklevel=1)
