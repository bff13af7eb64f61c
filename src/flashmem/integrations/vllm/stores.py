"""Where the vLLM connector keeps prefix records: a folder, an LMDB file, or a Valkey/Redis server.

All three hold flashmem's prefix records (`flashmem.serve.prefix`): hash-chain keys
(model, layout, tenant salt and every token of the prefix are in the key), and the
checked record bytes of `encode_record` (magic, xxh3-128 digest, safetensors that
name their key). A record that fails its check is never used: it is counted as
damaged, removed, and computed again by the next request that needs it.

- `disk`: `flashmem.serve.prefix.PrefixStore` (one 0600 file per record in a 0700
  folder, written atomically, LRU by last use under a quota). vLLM runs the
  scheduler and the worker as two connector objects (often two processes) over one
  folder, so `SharedFolderStore` also finds records that another process wrote
  after this one opened the folder, and recounts the folder before it evicts.
- `lmdb`: `LmdbPrefixStore` below: one LMDB environment (crash-safe commits,
  readers and writers across processes), records under their key, the last-use
  time and size of each in a second table, LRU eviction under a quota in the same
  transaction as the write. LMDB does not checksum values: the record's digest does.
- `redis://` / `rediss://`: `flashmem.serve.prefix_remote.RedisPrefixStore` (the
  server's LRU under `maxmemory`, a TTL per record, a down server costs reuse).
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import torch

from flashmem.errors import ColdStoreError, ConfigError
from flashmem.serve.prefix import DamagedRecordError, Entry, PrefixBackend, PrefixStore, decode_record, encode_record
from flashmem.store.private_fs import FILE_MODE, make_private_dirs, tighten

log = logging.getLogger(__name__)

BACKENDS = ("disk", "lmdb", "redis://HOST:PORT[/DB]", "rediss://...")


def open_backend(
    store: str, path: str | None, quota_bytes: int | None, *, ttl_s: int | None = None, rescan_s: float = 5.0
) -> PrefixBackend:
    """The prefix store `store` names; ConfigError (one line) naming what is allowed otherwise."""
    if store.startswith(("redis://", "rediss://")):
        from flashmem.serve.prefix_remote import DEFAULT_TTL_S, RedisPrefixStore

        return RedisPrefixStore(store, quota_bytes, ttl_s=ttl_s or DEFAULT_TTL_S)
    if store not in ("disk", "lmdb"):
        raise ConfigError(f"flashmem vLLM connector: store {store!r}; allowed: {', '.join(BACKENDS)}")
    if not path:
        raise ConfigError(f"flashmem vLLM connector: store {store!r} needs a 'path' (a folder this user owns)")
    if store == "disk":
        return SharedFolderStore(path, quota_bytes, rescan_s=rescan_s)
    return LmdbPrefixStore(path, quota_bytes)


class SharedFolderStore(PrefixStore):
    """`PrefixStore` over a folder that other processes write too (vLLM's worker saves, its
    scheduler looks up; other engines share the folder). A key missing from this process's
    index is looked for on disk before it counts as a miss, and the index is rebuilt from
    the folder at most every `rescan_s` seconds before an eviction, so the quota counts
    every process's records."""

    def __init__(self, root: str | Path, quota_bytes: int | None = None, *, rescan_s: float = 5.0) -> None:
        super().__init__(root, quota_bytes)
        self.rescan_s = rescan_s
        self._scanned = time.monotonic()

    def longest(self, keys: list[str]) -> int:
        n = 0
        for k in keys:
            with self._lock:
                known = k in self._entries
            if not known:
                try:
                    st = self._path(k).stat()
                except OSError:
                    break
                with self._lock:
                    self._entries.setdefault(k, Entry(parent="", nbytes=st.st_size, used=st.st_mtime))
            n += 1
        return n

    def evict(self) -> int:
        if self.quota_bytes is not None and time.monotonic() - self._scanned >= self.rescan_s:
            self.rescan()
        return super().evict()

    def rescan(self) -> None:
        """Rebuild the index from the folder (keeping this process's pins)."""
        found: dict[str, Entry] = {}
        for path in self.root.glob("*.fmprefix"):
            try:
                st = path.stat()
            except OSError:
                continue
            found[path.name[: -len(".fmprefix")]] = Entry(parent="", nbytes=st.st_size, used=st.st_mtime)
        with self._lock:
            for k, e in self._entries.items():
                if k in found:
                    found[k].pins = e.pins
                    found[k].used = max(found[k].used, e.used)
            self._entries = found
        self._scanned = time.monotonic()


_USE = struct.Struct("<dQ")  # last use (unix time), record bytes
_TOTAL = b"\x00total"  # in the use table: the sum of the record bytes (keys are hex, never start with NUL)
LMDB_MAP_SIZE = 2**40  # address space only: the file grows with what is written
_ENVS: dict[str, list[Any]] = {}  # realpath -> [environment, records table, use table, users]
_ENVS_LOCK = threading.Lock()


class LmdbPrefixStore:
    """Prefix records in one LMDB environment under `root` (0700, files 0600), LRU under
    `quota_bytes`. Same interface and counters as `PrefixStore` (`PrefixBackend`)."""

    def __init__(self, root: str | Path, quota_bytes: int | None = None, *, map_size: int = LMDB_MAP_SIZE) -> None:
        import lmdb

        self.root = Path(root)
        self.quota_bytes = quota_bytes
        self._lmdb_errors: tuple[type[BaseException], ...] = (lmdb.Error, OSError)
        try:
            make_private_dirs(str(self.root))
            st = os.lstat(self.root)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                raise ColdStoreError(f"prefix store folder {self.root}: not a folder; allowed: a folder you own")
            for name in ("data.mdb", "lock.mdb"):  # LMDB opens these itself: refuse planted links first
                p = self.root / name
                if os.path.lexists(p) and not stat.S_ISREG(os.lstat(p).st_mode):
                    raise ColdStoreError(f"prefix store {self.root}: {name} is not a regular file")
            self._where = os.path.realpath(self.root)
            with _ENVS_LOCK:  # LMDB allows one environment per file per process: share it
                shared = _ENVS.get(self._where)
                if shared is None:
                    env = lmdb.open(
                        str(self.root), map_size=map_size, subdir=True, max_dbs=2, mode=FILE_MODE, readahead=False
                    )
                    tighten(str(self.root))  # lmdb's mode goes through the umask
                    shared = [env, env.open_db(b"records"), env.open_db(b"use"), 0]
                    _ENVS[self._where] = shared
                shared[3] += 1
            self._env, self._records, self._use = shared[0], shared[1], shared[2]
        except self._lmdb_errors as exc:
            raise ColdStoreError(f"prefix store {self.root}: cannot open LMDB ({exc})") from None
        self._lock = threading.Lock()
        self._pins: dict[str, int] = {}
        self.evictions = 0
        self.damaged = 0
        self.unreachable = 0  # a local file is always there

    # ---------------------------------------------------------------- queries
    def __contains__(self, key: str) -> bool:
        with self._env.begin(db=self._records) as txn:
            return txn.get(key.encode(), db=self._records) is not None

    def longest(self, keys: list[str]) -> int:
        n = 0
        with self._env.begin() as txn:
            for k in keys:
                if txn.get(k.encode(), db=self._use) is None:
                    break
                n += 1
        return n

    def nbytes(self) -> int:
        with self._env.begin() as txn:
            raw = txn.get(_TOTAL, db=self._use)
        return _USE.unpack(raw)[1] if raw else 0

    def __len__(self) -> int:
        with self._env.begin() as txn:
            return int(txn.stat(self._records)["entries"])

    # ---------------------------------------------------------------- records
    def load(self, keys: list[str]) -> list[dict[str, torch.Tensor]]:
        """The records of the longest leading run of `keys` that are stored and check out; the
        first damaged one ends the run, is counted and deleted. The used records are touched."""
        out: list[dict[str, torch.Tensor]] = []
        bad: str | None = None
        with self._env.begin(buffers=True) as txn:
            for k in keys:
                val = txn.get(k.encode(), db=self._records)
                if val is None:
                    break
                try:
                    out.append(decode_record(k, bytes(val)))
                except DamagedRecordError as exc:
                    log.warning("prefix store %s: record %s not used (%s); removed", self.root, k[:12], exc)
                    bad = k
                    break
        if bad is not None:
            with self._lock:
                self.damaged += 1
            self._delete([bad])
        if out:
            now = time.time()
            with self._env.begin(write=True) as txn:
                for i, k in enumerate(keys[: len(out)]):  # parents before children: LRU evicts leaves first
                    raw = txn.get(k.encode(), db=self._use)
                    if raw is not None:
                        txn.put(k.encode(), _USE.pack(now + i * 1e-6, _USE.unpack(raw)[1]), db=self._use)
        return out

    def save(self, key: str, parent: str, record: dict[str, torch.Tensor], *, pin: bool = False) -> None:
        """Write a record (one commit with its use entry and the new total), then evict down to the quota."""
        data = encode_record(key, parent, record)
        try:
            with self._env.begin(write=True) as txn:
                old = txn.get(key.encode(), db=self._use)
                old_size = _USE.unpack(old)[1] if old else 0
                txn.put(key.encode(), data, db=self._records)
                txn.put(key.encode(), _USE.pack(time.time(), len(data)), db=self._use)
                self._add_total(txn, len(data) - old_size)
        except self._lmdb_errors as exc:
            raise ColdStoreError(f"prefix store {self.root}: cannot write a record: {exc}") from None
        if pin:
            self.pin([key])
        self.evict()

    def pin(self, keys: list[str]) -> None:
        """Keep `keys` from this process's evictions while a request builds on them."""
        with self._lock:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                if self._pins.get(k, 0) > 1:
                    self._pins[k] -= 1
                else:
                    self._pins.pop(k, None)
        self.evict()

    def evict(self) -> int:
        """Delete least recently used unpinned records while over the quota; returns how many."""
        if self.quota_bytes is None or self.nbytes() <= self.quota_bytes:
            return 0
        with self._lock:
            pins = set(self._pins)
        removed = 0
        with self._env.begin(write=True) as txn:
            total = _USE.unpack(txn.get(_TOTAL, db=self._use) or _USE.pack(0, 0))[1]
            entries: list[tuple[float, int, bytes]] = []
            for k, raw in txn.cursor(db=self._use):
                if k != _TOTAL:
                    used, size = _USE.unpack(raw)
                    entries.append((used, size, bytes(k)))
            for _used, size, k in sorted(entries):
                if total <= self.quota_bytes:
                    break
                if k.decode() in pins:
                    continue
                txn.delete(k, db=self._records)
                txn.delete(k, db=self._use)
                total -= size
                removed += 1
            txn.put(_TOTAL, _USE.pack(0, max(total, 0)), db=self._use)
        self.evictions += removed
        return removed

    def close(self) -> None:
        with _ENVS_LOCK:
            shared = _ENVS.get(self._where)
            if shared is None or shared[0] is not self._env:
                return
            shared[3] -= 1
            if shared[3] <= 0:
                del _ENVS[self._where]
                self._env.close()

    # ---------------------------------------------------------------- helpers
    def _add_total(self, txn: Any, delta: int) -> None:
        raw = txn.get(_TOTAL, db=self._use)
        total = _USE.unpack(raw)[1] if raw else 0
        txn.put(_TOTAL, _USE.pack(0, max(total + delta, 0)), db=self._use)

    def _delete(self, keys: list[str]) -> None:
        with self._env.begin(write=True) as txn:
            for k in keys:
                raw = txn.get(k.encode(), db=self._use)
                txn.delete(k.encode(), db=self._records)
                if raw is not None:
                    txn.delete(k.encode(), db=self._use)
                    self._add_total(txn, -_USE.unpack(raw)[1])
