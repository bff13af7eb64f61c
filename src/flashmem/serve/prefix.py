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

Files: `<root>/<h_j>.fmprefix`, each one record: an 8-byte magic, a 16-byte
xxh3-128 digest of everything after it, then the record in safetensors format
(its metadata holds the key and the parent hash). A record is checked before
use: one that fails (a flipped bit anywhere, header or payload; zeros; random
bytes; a truncation; a file renamed to another key) is never used: it costs the
reuse of that block and the ones after it, is counted (`damaged`, shown in
/metrics as `flashmem_prefix_damaged_records_total`) and removed. Records are
written atomically (temporary file, then rename), so the store survives a
restart and a crash never leaves half a record. The folder is 0700 and the
records 0600 (they encode the users' prompts), and no write follows a symlink.
The index follows the files: a record deleted from outside is dropped from it
when it is next looked up, and written again by the next prefill that computes
it. The last-use time is the file's mtime
(touched on every hit, leaf last), and the store evicts least recently used
records while it holds more than `quota_bytes`, skipping records pinned by a
live sequence. Evicting a record makes its descendants unreachable; they are
the least recently used ones next (a hit touches parents before children).
Files of the earlier unchecked format (`<h_j>.safetensors`) are removed on open.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flashmem.errors import ColdStoreError
from flashmem.store.private_fs import DIR_MODE, make_private_dirs, open_private

SUFFIX = ".fmprefix"
MAGIC = b"FMPFX\x00\x01\x00"  # format 1
DIGEST = 16  # xxh3-128
_OLD_FORMAT = re.compile(r"^[0-9a-f]{40}\.safetensors$")


class DamagedRecordError(Exception):
    """A record's bytes do not match its digest, or do not parse (internal: a miss)."""


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


def encode_record(key: str, parent: str, record: dict[str, torch.Tensor]) -> bytes:
    """The file bytes of a record: magic, digest of the rest, safetensors (key and parent in its metadata)."""
    body = st_save(record, metadata={"key": key, "parent": parent})
    return MAGIC + xxhash.xxh3_128_digest(body) + body


def decode_record(key: str, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a record file's bytes; DamagedRecordError unless every byte checks out."""
    if len(data) < len(MAGIC) + DIGEST or data[: len(MAGIC)] != MAGIC:
        raise DamagedRecordError("bad magic or truncated")
    body = memoryview(data)[len(MAGIC) + DIGEST :]
    if xxhash.xxh3_128_digest(body) != data[len(MAGIC) : len(MAGIC) + DIGEST]:
        raise DamagedRecordError("digest mismatch")
    try:
        tensors = st_load(bytes(body))
    except Exception as exc:  # noqa: BLE001 - verified bytes that do not parse are still damage
        raise DamagedRecordError(f"unreadable: {exc}") from None
    if _metadata_key(bytes(body)) != key:
        raise DamagedRecordError("record of another key")
    return tensors


def _metadata_key(body: bytes) -> str | None:
    """The `key` in a safetensors body's metadata (its JSON header: 8-byte length, then JSON)."""
    n = int.from_bytes(body[:8], "little")
    try:
        header = json.loads(body[8 : 8 + n])
    except ValueError:
        return None
    meta = header.get("__metadata__") or {}
    return meta.get("key") if isinstance(meta, dict) else None


class PrefixBackend(Protocol):
    """What the engine needs of a prefix store: this folder store, or a shared server
    (`flashmem.serve.prefix_remote.RedisPrefixStore`). Both use `chain`'s keys and
    `encode_record`/`decode_record`'s checked bytes; the counters only grow."""

    evictions: int  # records evicted under the quota (by this process)
    damaged: int  # records that failed their check (never used, removed)
    unreachable: int  # calls that could not reach the store (served without reuse)

    def __contains__(self, key: str) -> bool: ...
    def longest(self, keys: list[str]) -> int: ...
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    def load(self, keys: list[str]) -> list[dict[str, torch.Tensor]]: ...
    def save(self, key: str, parent: str, record: dict[str, torch.Tensor], *, pin: bool = False) -> None: ...
    def pin(self, keys: list[str]) -> None: ...
    def unpin(self, keys: list[str]) -> None: ...


class PrefixStore:
    """Records keyed by hash-chain keys, on disk under `root`, LRU under `quota_bytes`."""

    def __init__(self, root: str | Path, quota_bytes: int | None = None) -> None:
        self.root = Path(root)
        try:
            make_private_dirs(str(self.root))
            st = os.lstat(self.root)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                raise ColdStoreError(f"prefix store folder {self.root}: not a folder; allowed: a folder you own")
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != DIR_MODE:
                os.chmod(self.root, DIR_MODE)  # records encode prompts: this user only
            probe = self.root / f".probe-{os.getpid()}"
            os.close(open_private(str(probe), os.O_WRONLY | os.O_CREAT))
            probe.unlink()
        except OSError as exc:
            raise ColdStoreError(f"prefix store folder {self.root} is not writable: {exc.strerror or exc}") from None
        self.quota_bytes = quota_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self.evictions = 0
        self.damaged = 0  # records that failed their check (removed)
        self.unreachable = 0  # a local folder is always there (its write errors raise ColdStoreError)
        for path in self.root.glob("*" + SUFFIX):  # a restart: what earlier runs left
            try:
                st = path.stat()
            except OSError:
                continue
            self._entries[path.name[: -len(SUFFIX)]] = Entry(parent="", nbytes=st.st_size, used=st.st_mtime)
        for tmp in self.root.glob("*.tmp"):  # a crash mid-write
            tmp.unlink(missing_ok=True)
        for old in self.root.iterdir():  # unchecked records of the earlier format are never used
            if _OLD_FORMAT.match(old.name):
                old.unlink(missing_ok=True)

    # ---------------------------------------------------------------- queries
    def __contains__(self, key: str) -> bool:
        """Whether a record of `key` is stored (a record deleted from outside is dropped here)."""
        with self._lock:
            if key not in self._entries:
                return False
        if self._path(key).exists():
            return True
        self._drop(key)
        return False

    def longest(self, keys: list[str]) -> int:
        """How many leading keys of a chain are in the index (`load` checks their files)."""
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
    def load(self, keys: list[str]) -> list[dict[str, torch.Tensor]]:
        """The records of the longest leading run of `keys` whose files are there and check
        out, each touched. The first one that is gone (deleted, evicted meanwhile) or fails
        its check ends the run: it is dropped from the index and its file removed; the
        caller prefills from there."""
        out = []
        for k in keys:
            path = self._path(k)
            try:
                data = path.read_bytes()
            except OSError:  # gone: the index follows the files
                self._drop(k)
                break
            try:
                out.append(decode_record(k, data))
            except DamagedRecordError:
                with self._lock:
                    self.damaged += 1
                self._drop(k)
                break
        now = time.time()
        for i, k in enumerate(keys[: len(out)]):  # parents before children: LRU evicts leaves first
            self._touch(k, now + i * 1e-6)
        return out

    def save(self, key: str, parent: str, record: dict[str, torch.Tensor], *, pin: bool = False) -> None:
        """Write a record atomically (pinned at once with `pin`), then evict down to the quota."""
        path = self._path(key)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            data = encode_record(key, parent, record)
            fd = open_private(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, path)
            size = len(data)
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
