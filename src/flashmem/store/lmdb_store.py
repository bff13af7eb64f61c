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
import stat
import struct
import time
import warnings

import lmdb
import torch

from flashmem.errors import ChecksumError, ColdStoreError
from flashmem.store.base import BlockKey
from flashmem.store.codecs import DTYPE_CODES, DTYPES_BY_CODE, Codec
from flashmem.store.codecs.base import Shape
from flashmem.store.disk_io import store_error
from flashmem.store.format import HEADER_SIZE, RecordHeader, pack_header, unpack_header, xxh64
from flashmem.store.meta import read_meta, write_meta
from flashmem.store.private_fs import FILE_MODE, tighten
from flashmem.store.recovery import CorruptionWarning
from flashmem.store.transfer import host_buffer
from flashmem.store.write_behind import OnDiskStore, Pending, WriteBehindCore, WriteOptions

FORMAT = 1
BACKEND = "lmdb"
_KEY = struct.Struct(">iq")  # big-endian: LMDB's byte order sorts keys by (layer, block)
MAP_SIZE = 2**40  # address space only: the file grows with what is written
MIN_DATA_BYTES = 2 * 4096  # LMDB's two meta pages (its page size is the OS page size, 4 KiB or more)
ERRORS = (OSError, lmdb.Error)  # what opening or writing an environment raises


def _key(key: BlockKey) -> bytes:
    return _KEY.pack(int(key[0]), int(key[1]))


class _Core(WriteBehindCore):
    """The LMDB environment under the shared writer: one transaction per batch."""

    thread_prefix = "flashmem-lmdb"
    write_errors = ERRORS

    def __init__(
        self, folder: str, codec: Codec, opts: WriteOptions, lock_fd: int, *, map_size: int, create: bool
    ) -> None:
        super().__init__(folder, codec, opts, lock_fd)
        for name in ("data.mdb", "lock.mdb"):  # LMDB opens these itself: refuse planted links first
            p = os.path.join(folder, name)
            if os.path.lexists(p) and not stat.S_ISREG(os.lstat(p).st_mode):
                raise ColdStoreError(f"cold store {folder}: {name} is not a regular file; allowed: LMDB's own files")
        if not create:
            _check_has_content(folder)
        self.env = lmdb.open(
            folder,
            map_size=map_size,
            subdir=True,
            create=create,
            sync=opts.sync,
            metasync=opts.sync,
            readahead=False,
            max_readers=256,
            mode=FILE_MODE,
            lock=True,
        )
        try:
            tighten(folder)  # lmdb's mode goes through the umask
            _check_not_truncated(self.env, folder)
            if not create:
                _probe_in_child(folder, map_size)
            sizes, self.problems = self._scan()
        except BaseException:
            self.env.close()
            raise
        self.start(sizes)

    def _scan(self) -> tuple[dict[BlockKey, int], list[str]]:
        """(key -> payload bytes, one line per damaged entry) of what the file holds."""
        sizes: dict[BlockKey, int] = {}
        problems: list[str] = []
        with self.env.begin(buffers=True) as txn:
            for k, val in txn.cursor():
                h = unpack_header(bytes(val[:HEADER_SIZE]))
                key = _KEY.unpack(bytes(k)) if len(k) == _KEY.size else None
                if h is None or key is None or (h.layer, h.block) != key or len(val) != HEADER_SIZE + h.payload_len:
                    # a damaged key or header: never served under a wrong key, reported instead
                    problems.append(f"cold store {self.folder}/data.mdb: entry {bytes(k).hex()} is damaged; dropped")
                    continue
                sizes[key] = h.payload_len
        return sizes, problems

    # ------------------------------------------------------------- writing
    def _write_batch(self, batch: list[Pending]) -> list[int]:
        written = []
        with self.env.begin(write=True) as txn:  # one commit (and fsync when sync) per batch
            for item in batch:
                pay = item.payload.numpy()
                hdr = RecordHeader(
                    self.codec.code, DTYPE_CODES[item.dtype], item.key[0], item.key[1], item.shape, pay.size, xxh64(pay)
                )
                val = pack_header(hdr) + pay.tobytes()
                txn.put(_key(item.key), val)
                written.append(len(val))
        return written

    # ------------------------------------------------------------- reading
    def _read_stored(self, key: BlockKey, where: object) -> tuple[torch.Tensor, Shape, torch.dtype, float]:
        at = f"{os.path.join(self.folder, 'data.mdb')}: block (layer {key[0]}, block {key[1]})"
        t0 = time.perf_counter()
        try:
            with self.env.begin(buffers=True) as txn:
                val = txn.get(_key(key))
                if val is None:
                    if key in self.sizes:  # listed when opened, lost since: LMDB's tree is damaged
                        raise ChecksumError(f"{at}: listed in the store but LMDB cannot find it; the file is damaged")
                    raise KeyError(key)
                h = unpack_header(bytes(val[:HEADER_SIZE]))
                if h is None or (h.layer, h.block) != tuple(key) or len(val) != HEADER_SIZE + h.payload_len:
                    raise ChecksumError(f"{at}: record header damaged or not this block's")
                payload = host_buffer(h.payload_len)
                payload.numpy()[:] = memoryview(val)[HEADER_SIZE:]  # one copy out of the map
        except lmdb.Error as exc:
            raise ChecksumError(f"{at}: LMDB cannot read it ({exc})") from None
        dt = time.perf_counter() - t0  # lookup + copy from the map
        actual = xxh64(payload.numpy())
        if actual != h.payload_sum:
            raise ChecksumError(
                f"{at}: payload checksum mismatch (xxh64 stored {h.payload_sum:016x}, read {actual:016x}); "
                "the file was modified or damaged"
            )
        if h.dtype not in DTYPES_BY_CODE or h.codec != self.codec.code:
            raise ChecksumError(f"{at}: record of another codec or dtype")
        return payload, h.shape, DTYPES_BY_CODE[h.dtype], dt

    def _release(self) -> None:
        self.env.close()


class LmdbStore(OnDiskStore):
    """`LmdbStore(cold_dir, *, codec, dtype, name, persist, sync, max_pending_bytes,
    map_size=2**40)`; see OnDiskStore for the shared arguments."""

    tier = "lmdb"
    open_errors = ERRORS
    recovered: dict[str, int]  # set by reopen: kept / dropped entries

    def _create(self, folder: str, lock_fd: int, opts: WriteOptions, map_size: int = MAP_SIZE) -> _Core:
        write_meta(folder, FORMAT, self.codec.name, self.dtype, opts.persist, backend=BACKEND)
        return _Core(folder, self.codec, opts, lock_fd, map_size=map_size, create=True)

    def _reopen(self, path: str, lock_fd: int, opts: WriteOptions, verify: bool, map_size: int = MAP_SIZE) -> _Core:
        """LMDB's last committed transaction is the state; there is nothing to repair. A
        missing, emptied or truncated data.mdb is refused in one line (it is the store's
        whole content); a damaged key or record header is dropped and reported."""
        meta, self.codec, self.dtype = read_meta(path, (FORMAT,))
        if meta.get("backend") != BACKEND:
            raise ColdStoreError(
                f"cold store {path}: meta.json backend {meta.get('backend')!r}; allowed: 'lmdb' "
                "(open other folders with their own store)"
            )
        write_meta(path, FORMAT, self.codec.name, self.dtype, opts.persist, backend=BACKEND)
        core = _Core(path, self.codec, opts, lock_fd, map_size=map_size, create=False)
        self.recovered = {"kept": len(core.sizes), "dropped": len(core.problems)}
        self.problems = core.problems
        return core

    def _reopened(self, verify: bool) -> None:
        """Warn each damaged entry; verify=True reads every block now and drops none: a
        damaged one raises ChecksumError here instead of on first use."""
        for p in self.problems:
            warnings.warn(p, CorruptionWarning, stacklevel=3)
        if verify:
            for key in self.keys():
                self._core.read(key)


def _check_has_content(folder: str) -> None:
    """A reopened store's data.mdb is its whole content: LMDB would start a new, empty
    environment in place of a missing or emptied one, and every block would be gone
    without a word. Refuse both in one line instead."""
    data = os.path.join(folder, "data.mdb")
    try:
        size = os.lstat(data).st_size
    except FileNotFoundError:
        raise ColdStoreError(
            f"cold store {folder}: data.mdb is missing (it holds every block of this store); "
            "allowed: an intact LMDB store folder"
        ) from None
    if size == 0:
        raise ColdStoreError(
            f"cold store {folder}: data.mdb is empty (0 bytes; it held every block of this store); "
            "allowed: an intact LMDB store folder"
        )
    if size < MIN_DATA_BYTES:
        raise ColdStoreError(
            f"cold store {folder}: data.mdb is truncated ({size} bytes; an LMDB file starts with two meta "
            f"pages, {MIN_DATA_BYTES} bytes at least); allowed: an intact LMDB store folder"
        )


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


# Run by `_probe_in_child` in a separate interpreter (lmdb and xxhash only, no torch):
# every read the store can make of this file (the cursor scan at open, `get` of a
# listed block), made once where a fault kills only the probe. argv: folder,
# map_size, path of flashmem/store/format.py.
_PROBE = """
import importlib.util, sys
import lmdb
spec = importlib.util.spec_from_file_location("flashmem_store_format", sys.argv[3])
fmt = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = fmt
spec.loader.exec_module(fmt)
env = lmdb.open(sys.argv[1], map_size=int(sys.argv[2]), subdir=True, readonly=True, lock=False, readahead=False)
with env.begin(buffers=True) as txn:
    for key, val in txn.cursor():
        h = fmt.unpack_header(bytes(val[: fmt.HEADER_SIZE]))
        if h is not None and len(val) == fmt.HEADER_SIZE + h.payload_len:
            val[len(val) - 1]  # a value is contiguous in the map: if its last byte is in the file, all are
"""


def _probe_in_child(folder: str, map_size: int) -> None:
    """LMDB maps its file and trusts its own pages: a damaged page can point a read past
    the end of the file, and the read then kills the process (SIGBUS), with no error to
    catch. Every read this store will make of a reopened file is made first in a child
    process; if the child dies by a signal the store is refused in one line, and this
    process never touches the bad page. A child that fails otherwise (an LMDB error) is
    ignored: the same error comes back, in one line, from the scan that follows."""
    import signal
    import subprocess
    import sys

    from flashmem.store import format as fmt

    args = [sys.executable, "-c", _PROBE, folder, str(map_size), os.path.abspath(fmt.__file__)]
    try:
        proc = subprocess.run(args, capture_output=True, timeout=None, check=False)
    except OSError as exc:
        raise store_error(folder, "cannot check data.mdb in a separate process", exc) from None
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        raise ColdStoreError(
            f"cold store {folder}: data.mdb is damaged: reading it kills the reader ({sig}; LMDB maps the file "
            "and does not check its own pages), so it is refused before this process reads it; "
            "allowed: an intact LMDB store folder"
        )
