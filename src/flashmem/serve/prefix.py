"""Cross-request prefix reuse: a persistent, hash-chained store of cache state.

A prompt is cut into prefix blocks of `block_tokens` tokens (a multiple of the
cache's block size B, so each prefix block ends on a sealed-block boundary of
the history). Block j's key is a hash chain:

    h_j = blake2b(h_{j-1} | model fingerprint | config fingerprint | tenant salt | token ids of block j)

so a key names the whole prefix up to and including block j, for one model,
one config and one tenant. The record stored under h_j is what the cache gained
during block j (`flashmem.serve.state.export_delta`: sealed blocks' exact K/V,
their HCA entries and index pages, plain layers' K/V) plus the bounded tail at
its end; records 1..j rebuild the state after block j exactly.

Files: `<root>/<h_j>.safetensors` (parent hash in the metadata), written
atomically (temporary file, then rename), so the store survives a restart and
a crash never leaves half a record. The last-use time is the file's mtime
(touched on every hit, leaf last), and the store evicts least recently used
records while it holds more than `quota_bytes`, skipping records pinned by a
live sequence. Evicting a record makes its descendants unreachable; they are
the least recently used ones next (a hit touches parents before children).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flashmem.errors import ColdStoreError

SUFFIX = ".safetensors"


@dataclass
class Entry:
    parent: str
    nbytes: int
    used: float
    pins: int = 0


def chain(tokens: list[int], block_tokens: int, fingerprint: str, salt: str, limit: int | None = None) -> list[str]:
    """Hash keys of the prompt's full prefix blocks (at most `limit`)."""
    n = len(tokens) // block_tokens
    if limit is not None:
        n = min(n, limit)
    keys: list[str] = []
    parent = ""
    for j in range(n):
        h = hashlib.blake2b(digest_size=20)
        h.update(parent.encode())
        h.update(b"|" + fingerprint.encode() + b"|" + salt.encode() + b"|")
        h.update(torch.tensor(tokens[j * block_tokens : (j + 1) * block_tokens], dtype=torch.int64).numpy().tobytes())
        parent = h.hexdigest()
        keys.append(parent)
    return keys


class PrefixStore:
    """Records keyed by hash-chain keys, on disk under `root`, LRU under `quota_bytes`."""

    def __init__(self, root: str | Path, quota_bytes: int | None = None) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ColdStoreError(f"prefix store folder {self.root} is not writable: {exc.strerror or exc}") from None
        self.quota_bytes = quota_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self.evictions = 0
        for path in self.root.glob("*" + SUFFIX):  # a restart: what earlier runs left
            try:
                st = path.stat()
            except OSError:
                continue
            self._entries[path.name[: -len(SUFFIX)]] = Entry(parent="", nbytes=st.st_size, used=st.st_mtime)
        for tmp in self.root.glob("*.tmp"):  # a crash mid-write
            tmp.unlink(missing_ok=True)

    # ---------------------------------------------------------------- queries
    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def longest(self, keys: list[str]) -> int:
        """How many leading keys of a chain are stored."""
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._entries:
                    break
                n += 1
            return n

    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # ---------------------------------------------------------------- records
    def load(self, keys: list[str]) -> list[dict[str, torch.Tensor]] | None:
        """The records of `keys` in order, each touched; None when one is gone or unreadable
        (evicted meanwhile, damaged): the caller prefills instead."""
        out = []
        for k in keys:
            try:
                out.append(load_file(str(self._path(k))))
            except Exception:  # noqa: BLE001 - a damaged or vanished record is a miss, never a failure
                self._drop(k)
                return None
        now = time.time()
        for i, k in enumerate(keys):  # parents before children: LRU evicts leaves first
            self._touch(k, now + i * 1e-6)
        return out

    def save(self, key: str, parent: str, record: dict[str, torch.Tensor], *, pin: bool = False) -> None:
        """Write a record atomically (pinned at once with `pin`), then evict down to the quota."""
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_file(record, str(tmp), metadata={"parent": parent})
            os.replace(tmp, path)
            size = path.stat().st_size
        except Exception as exc:  # OSError, or safetensors' own error type for the same causes
            tmp.unlink(missing_ok=True)
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ColdStoreError(f"prefix store {self.root}: cannot write a record: {reason}") from None
        with self._lock:
            old = self._entries.get(key)
            pins = (old.pins if old else 0) + int(pin)
            self._entries[key] = Entry(parent=parent, nbytes=size, used=time.time(), pins=pins)
        self.evict()

    def pin(self, keys: list[str]) -> None:
        """Keep `keys` from eviction while a live sequence builds on them."""
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    e.pins += 1

    def unpin(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None and e.pins > 0:
                    e.pins -= 1
        self.evict()

    def evict(self) -> int:
        """Remove least recently used unpinned records while over quota; returns how many."""
        if self.quota_bytes is None:
            return 0
        removed = 0
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            for key, e in sorted(self._entries.items(), key=lambda kv: kv[1].used):
                if total <= self.quota_bytes:
                    break
                if e.pins:
                    continue
                self._path(key).unlink(missing_ok=True)
                del self._entries[key]
                total -= e.nbytes
                removed += 1
        self.evictions += removed
        return removed

    # ---------------------------------------------------------------- helpers
    def _path(self, key: str) -> Path:
        return self.root / (key + SUFFIX)

    def _touch(self, key: str, when: float) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                e.used = when
        try:
            os.utime(self._path(key), (when, when))
        except OSError:
            pass

    def _drop(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)
        self._path(key).unlink(missing_ok=True)
