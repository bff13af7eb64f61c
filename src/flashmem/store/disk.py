"""Disk cold tier: append-only checksummed segment files, written in the background.

`put` encodes the block (on its device), copies the payload to host memory and
queues it; the block is readable at once (from memory until its record is
durable, then with `os.preadv` from its segment file). Every store gets its own
folder `<cold_dir>/<name>-<pid>-<uuid>`, removed by `close()` (or when the store
is garbage-collected, or at exit) unless persist=True. `DiskStore.reopen(folder)`
recovers a persisted folder. Layout: see `flashmem.store.format`; the writer,
the folder set-up and the API are shared with LmdbStore
(`flashmem.store.write_behind`).
"""

from __future__ import annotations

from flashmem.store.disk_core import DiskCore
from flashmem.store.format import FORMAT_VERSION
from flashmem.store.meta import write_meta
from flashmem.store.private_fs import tighten
from flashmem.store.recovery import recover
from flashmem.store.write_behind import OnDiskStore, WriteOptions

SEGMENT_BYTES = 2**30  # a segment file rolls over past this size


class DiskStore(OnDiskStore):
    """`DiskStore(cold_dir, *, codec, dtype, name, persist, sync, max_pending_bytes,
    segment_bytes=2**30)`; see OnDiskStore for the shared arguments."""

    tier = "disk"
    recovered: dict[str, int]  # set by reopen: kept, dropped, torn_log_bytes, corrupt_log_entries, ...

    def _create(self, folder: str, lock_fd: int, opts: WriteOptions, segment_bytes: int = SEGMENT_BYTES) -> DiskCore:
        write_meta(folder, FORMAT_VERSION, self.codec.name, self.dtype, opts.persist)
        return DiskCore(folder, self.codec, opts, lock_fd, segment_bytes=segment_bytes)

    def _reopen(
        self, path: str, lock_fd: int, opts: WriteOptions, verify: bool, segment_bytes: int = SEGMENT_BYTES
    ) -> DiskCore:
        """Every committed record is kept. A torn tail of the commit log is cut off; a
        damaged entry before intact ones is corruption: it is reported (`self.problems`,
        one warning line each) and the intact entries after it are kept. verify=True
        also reads every payload and drops records whose checksum fails. New puts go to
        a new segment."""
        rec = recover(path, verify=verify)
        self.codec, self.dtype = rec.codec, rec.dtype
        self.recovered, self.problems = rec.report, rec.problems
        tighten(path)
        write_meta(path, FORMAT_VERSION, rec.codec.name, rec.dtype, opts.persist)
        return DiskCore(
            path,
            rec.codec,
            opts,
            lock_fd,
            segment_bytes=segment_bytes,
            index=rec.index,
            first_segment=rec.next_segment,
            log_offset=rec.log_length,
        )
