"""Disk cold tier: append-only checksummed segment files, written in the background.

`put` encodes the block (on its device), copies the payload to host memory and
queues it; the block is readable at once (from memory until its record is
durable, then with `os.preadv` from its segment file). Every store gets its own
folder `<cold_dir>/<name>-<pid>-<uuid>`, removed by `close()` (or when the store
is garbage-collected, or at exit) unless persist=True. `DiskStore.reopen(folder)`
recovers a persisted folder. Layout: see `flashmem.store.format`.
"""

from __future__ import annotations

import os
import re
import uuid
import weakref

import torch

from flashmem.errors import ColdStoreError
from flashmem.store.base import BlockKey, ColdStore, StoreStats
from flashmem.store.codecs import DTYPE_CODES, get_codec
from flashmem.store.codecs.base import Shape, check_pair
from flashmem.store.disk_core import DiskCore, Pending
from flashmem.store.disk_io import store_error
from flashmem.store.format import FORMAT_VERSION
from flashmem.store.locking import lock_folder, unlock
from flashmem.store.meta import write_meta
from flashmem.store.private_fs import check_own_folder, make_private_dir, make_private_dirs, tighten
from flashmem.store.recovery import recover
from flashmem.store.transfer import decode_on, ensure_host


class DiskStore(ColdStore):
    tier = "disk"
    coded_reads = True
    recovered: dict[str, int]  # set by reopen: kept, dropped, torn_log_bytes, corrupt_log_entries, ...
    problems: list[str]  # set by reopen: one line per corruption found (also warned)

    def __init__(
        self,
        cold_dir: str,
        *,
        codec: str = "exact",
        dtype: torch.dtype = torch.float16,
        name: str | None = None,
        persist: bool = False,
        sync: bool = True,
        segment_bytes: int = 2**30,
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
            _write_meta(folder, self.codec.name, dtype, persist)
            core = DiskCore(
                folder,
                self.codec,
                persist=persist,
                sync=sync,
                segment_bytes=segment_bytes,
                max_pending_bytes=max_pending_bytes,
                lock_fd=lock,
            )
        except OSError as exc:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
            unlock(lock)
            raise store_error(folder, "cannot write the store folder", exc, hint) from None
        self._attach(core)

    def _attach(self, core: DiskCore) -> None:
        self._core = core
        self.stats: StoreStats = core.stats
        self._finalizer = weakref.finalize(self, _close_unattended, core)

    @classmethod
    def reopen(
        cls,
        path: str,
        *,
        persist: bool = True,
        verify: bool = False,
        sync: bool = True,
        segment_bytes: int = 2**30,
        max_pending_bytes: int = 256 * 2**20,
    ) -> DiskStore:
        """Open a persisted store folder: every committed record is kept. A torn tail of
        the commit log is cut off; a damaged entry before intact ones is corruption: it
        is reported (`self.problems`, one warning line each) and the intact entries after
        it are kept. verify=True also reads every payload and drops records whose
        checksum fails. New puts go to a new segment. The folder must be a real folder
        owned by this user and not open elsewhere (ColdStoreError otherwise)."""
        path = os.path.abspath(path)
        check_own_folder(path)
        lock = lock_folder(path)
        try:
            rec = recover(path, verify=verify)
            self = cls.__new__(cls)
            self.codec = rec.codec
            self.dtype = rec.dtype
            self.recovered = rec.report
            self.problems = rec.problems
            try:
                tighten(path)
                _write_meta(path, rec.codec.name, rec.dtype, persist)
                core = DiskCore(
                    path,
                    rec.codec,
                    persist=persist,
                    sync=sync,
                    segment_bytes=segment_bytes,
                    max_pending_bytes=max_pending_bytes,
                    index=rec.index,
                    first_segment=rec.next_segment,
                    log_offset=rec.log_length,
                    lock_fd=lock,
                )
            except OSError as exc:
                raise store_error(path, "cannot reopen", exc) from None
        except BaseException:
            unlock(lock)
            raise
        self._attach(core)
        return self

    # ------------------------------------------------------------------ API
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
        core = self._core
        core.enqueue(Pending(key, payload, tuple(shape), dtype))  # type: ignore[arg-type]
        self._raise_once()

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        payload, shape, dtype, shared = self._core.read(key)
        return decode_on(self.codec, payload, shape, dtype, device, shared)

    def get_coded(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        """(payload uint8 [n] host, shape, dtype, shared); raises ChecksumError on damaged bytes."""
        return self._core.read(key)

    def __contains__(self, key: object) -> bool:
        core = self._core
        return key in core.pending or key in core.index

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
        self._core.wait_durable()
        core = self._core
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

    def _raise_once(self) -> None:
        core = self._core
        if core.error is not None and not core.error_reported:
            core.error_reported = True
            raise ColdStoreError(str(core.error))


def _close_unattended(core: DiskCore) -> None:
    """Close run by garbage collection or at exit: nobody to raise to, so say it on stderr."""
    core.close()
    if core.leftover:
        import warnings

        warnings.warn(core.leftover, RuntimeWarning, stacklevel=1)


def _write_meta(folder: str, codec: str, dtype: torch.dtype, persist: bool) -> None:
    write_meta(folder, FORMAT_VERSION, codec, dtype, persist)
