"""Disk cold tier: append-only checksummed segment files, written in the background.

`put` encodes the block (on its device), copies the payload to host memory and
queues it; the block is readable at once (from memory until its record is
durable, then with `os.preadv` from its segment file). Every store gets its own
folder `<cold_dir>/<name>-<pid>-<uuid>`, removed by `close()` (or when the store
is garbage-collected, or at exit) unless persist=True. `DiskStore.reopen(folder)`
recovers a persisted folder. Layout: see `flashmem.store.format`.
"""

from __future__ import annotations

import json
import os
import re
import socket
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
from flashmem.store.recovery import recover
from flashmem.store.transfer import decode_on, ensure_host


class DiskStore(ColdStore):
    tier = "disk"
    coded_reads = True

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
            os.makedirs(cold_dir, exist_ok=True)
            if not os.path.isdir(cold_dir):
                raise NotADirectoryError(20, "Not a directory")
            os.mkdir(folder)
        except OSError as exc:
            raise store_error(str(cold_dir), "cannot create the store folder", exc, hint) from None
        try:
            _write_meta(folder, self.codec.name, dtype, persist)
            core = DiskCore(
                folder,
                self.codec,
                persist=persist,
                sync=sync,
                segment_bytes=segment_bytes,
                max_pending_bytes=max_pending_bytes,
            )
        except OSError as exc:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
            raise store_error(folder, "cannot write the store folder", exc, hint) from None
        self._attach(core)

    def _attach(self, core: DiskCore) -> None:
        self._core = core
        self.stats: StoreStats = core.stats
        self._finalizer = weakref.finalize(self, core.close)

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
        """Open a persisted store folder: every committed record is kept; incomplete or
        garbled trailing records are ignored (verify=True also reads every payload and
        drops records whose checksum fails). New puts go to a new segment."""
        rec = recover(path, verify=verify)
        self = cls.__new__(cls)
        self.codec = rec.codec
        self.dtype = rec.dtype
        self.recovered = rec.report  # type: ignore[attr-defined]
        try:
            _write_meta(path, rec.codec.name, rec.dtype, persist)
            core = DiskCore(
                os.path.abspath(path),
                rec.codec,
                persist=persist,
                sync=sync,
                segment_bytes=segment_bytes,
                max_pending_bytes=max_pending_bytes,
                index=rec.index,
                first_segment=rec.next_segment,
                log_offset=rec.log_length,
            )
        except OSError as exc:
            raise store_error(path, "cannot reopen", exc) from None
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
        """Persisting stores drain their writes first; otherwise the folder is removed."""
        try:
            if self._core.persist and not self._core.closed:
                self.flush()
        finally:
            self._finalizer()

    def _raise_once(self) -> None:
        core = self._core
        if core.error is not None and not core.error_reported:
            core.error_reported = True
            raise ColdStoreError(str(core.error))


def _write_meta(folder: str, codec: str, dtype: torch.dtype, persist: bool) -> None:
    meta = {
        "format": FORMAT_VERSION,
        "codec": codec,
        "dtype": str(dtype).removeprefix("torch."),
        "persist": persist,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    tmp = os.path.join(folder, "meta.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, "meta.json"))
