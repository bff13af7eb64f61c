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

Files: `<root>/<h_j>.fmprefix`, each one record (format 2): an 8-byte magic, a
16-byte xxh3-128 digest of everything after it, then the record in safetensors
format (its metadata holds the key, the parent hash and the codec). Each K/V pair
of the record (`<name>.k`/`.v`, `flashmem.serve.state`) is stored as the cold tier
stores a block (`flashmem.store.format`): a 64-byte header (codec, dtype, shape,
payload length, the payload's xxh64, the header's own xxh64) and the payload coded
by a cold-tier codec (`flashmem.store.codecs`), as one uint8 tensor `<name>.fmb`.
The store's codec (`codec=`) is `int8` by default: KIVI groups of 32, 1.125 bytes
per element against 4 for fp32, so a stored SmolLM2 document is about a fifth of
format 1's full fp32 copies (benchmarks/prefix_bytes.py, results/prefix_bytes_*.json),
and the reused request's answers are the cold request's within the codec's error
(greedy tokens identical in those runs; not guaranteed for every prompt). `exact`
keeps the model dtype's bytes: a restored prefix then continues bit for bit as a
fresh prefill, at about 3/4 of format 1's bytes. A record of another codec than the
store's is not used (it is counted as damaged, removed and written again).

A record is checked before use: one that fails (a flipped bit anywhere, header or payload; zeros; random
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
Files of the earlier unchecked format (`<h_j>.safetensors`) are removed on open,
and so are format 1 records (full fp32 copies of the state, with a warning naming
how many); a format 1 record met later (another replica's, on a shared store) is
refused the same way: counted as damaged, removed, computed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
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

from flashmem.errors import ColdStoreError, ConfigError
from flashmem.store import format as coldfmt
from flashmem.store.codecs import CODECS, CODECS_BY_CODE, DTYPE_CODES, DTYPES_BY_CODE, get_codec
from flashmem.store.private_fs import DIR_MODE, make_private_dirs, open_private

log = logging.getLogger(__name__)

SUFFIX = ".fmprefix"
MAGIC = b"FMPFX\x00\x02\x00"  # format 2: K/V pairs coded as cold-tier blocks
MAGIC_V1 = b"FMPFX\x00\x01\x00"  # format 1: full fp32 copies (refused)
DIGEST = 16  # xxh3-128
DEFAULT_CODEC = "int8"
CODED = ".fmb"  # suffix of a coded K/V pair in the safetensors body
_OLD_FORMAT = re.compile(r"^[0-9a-f]{40}\.safetensors$")


class DamagedRecordError(Exception):
    """A record's bytes do not match its digest, or do not parse (internal: a miss)."""


class OldFormatError(DamagedRecordError):
    """A record of format 1 (full fp32 copies, before coded records): never used."""


def check_codec(name: str) -> str:
    """The record codec's name; ConfigError naming the allowed ones otherwise."""
    if name not in CODECS:
        raise ConfigError(f"prefix record codec {name!r}; allowed: {', '.join(sorted(CODECS))}")
    return name


def is_format_1(data: bytes) -> bool:
    return data[: len(MAGIC_V1)] == MAGIC_V1


@dataclass
class Entry:
    parent: str
    nbytes: int
    used: float
    pins: int = 0


# An end record: the state a prompt reaches END_TAIL tokens before its end, stored beside
# its full blocks so that the same prompt again re-runs END_TAIL tokens, not up to a whole
# block (the reused request's time at the recipe's 512-token blocks went almost all to that
# re-prefilled tail: benchmarks/prefix_bytes.py). The engine writes and restores them
# (Engine._admit / _prefill_chunk, on whenever it has a store); they are records like the
# blocks' (same bytes, checks, pins and eviction), under their own keys. Two, not one: the
# final forward must be a prompt forward (more than one token) to attend the prompt exactly
# as the cold request's did.
END_TAIL = 2


def end_point(n_tokens: int, block_tokens: int) -> int:
    """Where a prompt of n_tokens has its end record: n_tokens - END_TAIL when that lies after
    its last full prefix block (the blocks that end before its last token), else 0 (none).
    The prompt's chunks end there too, cold or reused, so both run the same forwards."""
    last_block_end = ((n_tokens - 1) // block_tokens) * block_tokens
    m = n_tokens - END_TAIL
    return m if m > last_block_end else 0


def end_key(parent: str, tokens: list[int], fingerprint: str, salt: str) -> str:
    """The key of an end record: its parent (the last full block's key, "" for none) and the
    tokens after that block up to the end point; tagged, so no full block's key equals it."""
    h = hashlib.blake2b(digest_size=20)
    h.update(parent.encode())
    h.update(b"|end|" + fingerprint.encode() + b"|" + salt.encode() + b"|")
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


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


def _is_pair(record: dict[str, torch.Tensor], name: str) -> bool:
    """Whether `name` is the K of a K/V pair the codec codes: `<base>.k` with a `<base>.v` of
    its shape and dtype, 4-D, a float dtype the cold tier knows, not empty."""
    if not name.endswith(".k"):
        return False
    k, v = record[name], record.get(name[:-2] + ".v")
    return (
        v is not None
        and k.dim() == 4
        and k.shape == v.shape
        and k.dtype == v.dtype
        and k.dtype in DTYPE_CODES
        and k.numel() > 0
    )


def _layer_of(name: str) -> int:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def encode_record(key: str, parent: str, record: dict[str, torch.Tensor], codec: str = DEFAULT_CODEC) -> bytes:
    """The file bytes of a record: magic, digest of the rest, safetensors (key, parent and codec
    in its metadata). Each K/V pair becomes one cold-tier block: header | coded payload."""
    c = get_codec(codec)
    tensors: dict[str, torch.Tensor] = {}
    # pairs the codec makes smaller (a group of 32 pads a short one: a few CSA entries stay raw)
    pairs = {
        name[:-2]
        for name, t in record.items()
        if _is_pair(record, name) and c.nbytes(tuple(t.shape), t.dtype) < 2 * t.nbytes  # type: ignore[arg-type]
    }
    for name, t in record.items():
        base = name[:-2]
        if base in pairs and name in (base + ".k", base + ".v"):
            if name.endswith(".v"):
                continue
            k, v = t, record[base + ".v"]
            payload = c.encode(k, v).contiguous()
            header = coldfmt.RecordHeader(
                c.code,
                DTYPE_CODES[k.dtype],
                _layer_of(name),
                0,
                tuple(int(x) for x in k.shape),  # type: ignore[arg-type]
                payload.numel(),
                coldfmt.xxh64(payload.numpy()),
            )
            head = torch.frombuffer(bytearray(coldfmt.pack_header(header)), dtype=torch.uint8)
            tensors[base + CODED] = torch.cat([head, payload])
        else:
            tensors[name] = t
    body = st_save(tensors, metadata={"key": key, "parent": parent, "codec": c.name})
    return MAGIC + xxhash.xxh3_128_digest(body) + body


def decode_record(key: str, data: bytes, codec: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a record file's bytes (K/V pairs decoded); DamagedRecordError unless every
    byte checks out (OldFormatError for a format 1 record), and unless the record was coded
    with `codec` (when given)."""
    if is_format_1(data):
        raise OldFormatError("a format 1 record (full fp32 copies)")
    if len(data) < len(MAGIC) + DIGEST or data[: len(MAGIC)] != MAGIC:
        raise DamagedRecordError("bad magic or truncated")
    body = memoryview(data)[len(MAGIC) + DIGEST :]
    if xxhash.xxh3_128_digest(body) != data[len(MAGIC) : len(MAGIC) + DIGEST]:
        raise DamagedRecordError("digest mismatch")
    try:
        tensors = st_load(bytes(body))
    except Exception as exc:  # noqa: BLE001 - verified bytes that do not parse are still damage
        raise DamagedRecordError(f"unreadable: {exc}") from None
    meta = _metadata(bytes(body))
    if meta.get("key") != key:
        raise DamagedRecordError("record of another key")
    if codec is not None and meta.get("codec") != codec:
        raise DamagedRecordError(f"record coded {meta.get('codec')!r}, the store codes {codec!r}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.endswith(CODED):
            out[name] = t
            continue
        base = name[: -len(CODED)]
        out[base + ".k"], out[base + ".v"] = _decode_block(name, t)
    return out


def _decode_block(name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One coded K/V pair (cold-tier header | payload) -> (k, v); DamagedRecordError on any mismatch."""
    raw = t.numpy()
    h = coldfmt.unpack_header(raw[: coldfmt.HEADER_SIZE].tobytes()) if t.dtype == torch.uint8 else None
    if h is None or h.codec not in CODECS_BY_CODE or h.dtype not in DTYPES_BY_CODE:
        raise DamagedRecordError(f"{name}: not a cold-tier block")
    payload = t[coldfmt.HEADER_SIZE :]
    if payload.numel() != h.payload_len or coldfmt.xxh64(raw[coldfmt.HEADER_SIZE :]) != h.payload_sum:
        raise DamagedRecordError(f"{name}: payload does not match its header")
    try:
        return CODECS_BY_CODE[h.codec].decode(payload, h.shape, DTYPES_BY_CODE[h.dtype])
    except ValueError as exc:
        raise DamagedRecordError(f"{name}: {exc}") from None


def _metadata(body: bytes) -> dict[str, str]:
    """The metadata of a safetensors body (its JSON header: 8-byte length, then JSON); {} if none."""
    n = int.from_bytes(body[:8], "little")
    try:
        header = json.loads(body[8 : 8 + n])
    except ValueError:
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


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
    """Records keyed by hash-chain keys, on disk under `root`, LRU under `quota_bytes`; K/V pairs
    coded with `codec` (a cold-tier codec: int8, the default, int4 or exact; module docstring)."""

    def __init__(self, root: str | Path, quota_bytes: int | None = None, *, codec: str = DEFAULT_CODEC) -> None:
        self.codec = check_codec(codec)
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
        old_records = 0
        for path in self.root.glob("*" + SUFFIX):  # a restart: what earlier runs left
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC_V1))
            except OSError:
                continue
            if is_format_1(head):  # full fp32 copies: refused (computed again, coded)
                path.unlink(missing_ok=True)
                old_records += 1
                continue
            self._entries[path.name[: -len(SUFFIX)]] = Entry(parent="", nbytes=st.st_size, used=st.st_mtime)
        if old_records:
            log.warning(
                "prefix store %s: removed %d records of format 1 (full fp32 copies); "
                "they are computed again, coded, by the next requests that need them",
                self.root,
                old_records,
            )
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
        caller prefills from there. A damaged one also drops the keys after it (unchecked:
        the prefill computes them and writes them again, so a chain of another codec or
        format is replaced in one request, not one record per request)."""
        out = []
        for i, k in enumerate(keys):
            path = self._path(k)
            try:
                data = path.read_bytes()
            except OSError:  # gone: the index follows the files
                self._drop(k)
                break
            try:
                out.append(decode_record(k, data, self.codec))
            except DamagedRecordError as exc:
                with self._lock:
                    self.damaged += 1
                log.warning("prefix store %s: record %s not used (%s); removed", self.root, k[:12], exc)
                for later in keys[i:]:
                    self._drop(later)
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
            data = encode_record(key, parent, record, self.codec)
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
