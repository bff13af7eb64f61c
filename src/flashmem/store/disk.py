"""Disk cold tier: append-only checksummed segment files, written in the background.

`put` encodes the block (on its device), copies the payload to host memory and
queues it; the block is readable at once (from memory until its record is
durable, then with `os.preadv` from its segment file). Every store gets its own
folder `<cold_dir>/<name>-<pid>-<uuid>`, removed by `close()` (or when the store
is garbage-collected, or at exit) unless persist=True. `DiskStore.reopen(folder)`
recovers a persisted folder. With the exact codec `gather_pages` reads just the pages asked
for (runs of a record, checked against per-unit sums kept in RAM: store/page_sums.py), not
whole blocks. Layout: see `flashmem.store.format`; the writer,
the folder set-up and the API are shared with LmdbStore
(`flashmem.store.write_behind`).
"""

from __future__ import annotations

import numpy as np
import torch

from flashmem.store.disk_core import DiskCore
from flashmem.store.format import FORMAT_VERSION
from flashmem.store.meta import write_meta
from flashmem.store.page_sums import SUM_TOKENS, unit_bytes
from flashmem.store.private_fs import tighten
from flashmem.store.recovery import recover
from flashmem.store.write_behind import OnDiskStore, WriteOptions

SEGMENT_BYTES = 2**30  # a segment file rolls over past this size


class DiskStore(OnDiskStore):
    """`DiskStore(cold_dir, *, codec, dtype, name, persist, sync, max_pending_bytes,
    segment_bytes=2**30, unit_tokens=4)`; see OnDiskStore for the shared arguments.
    unit_tokens: tokens of one checksummed unit (store/page_sums.py); `gather_pages` reads pages
    of whole units (the cache opens its disk tier with its page size: `flashmem.store.open_disk`)."""

    tier = "disk"
    recovered: dict[str, int]  # set by reopen: kept, dropped, torn_log_bytes, corrupt_log_entries, ...

    def _create(
        self,
        folder: str,
        lock_fd: int,
        opts: WriteOptions,
        segment_bytes: int = SEGMENT_BYTES,
        unit_tokens: int = SUM_TOKENS,
    ) -> DiskCore:
        write_meta(folder, FORMAT_VERSION, self.codec.name, self.dtype, opts.persist)
        return DiskCore(folder, self.codec, opts, lock_fd, segment_bytes=segment_bytes, unit_tokens=unit_tokens)

    def _reopen(
        self,
        path: str,
        lock_fd: int,
        opts: WriteOptions,
        verify: bool,
        segment_bytes: int = SEGMENT_BYTES,
        unit_tokens: int = SUM_TOKENS,
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
            unit_tokens=unit_tokens,
        )

    @property
    def page_reads(self) -> bool:
        return self.codec.name == "exact"  # records of coded blocks are read whole

    def gather_pages(
        self,
        layer_idx: int,
        blocks: torch.Tensor,
        within: torch.Tensor,
        pages_per_block: int,
        device: torch.device | str,
        keys: bool = True,
        values: bool = True,
        only: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """Pages read alone: blocks, within [b, h, k] (block id and page within it, per row and
        KV head) -> k, v [b, h, k, P, d] on `device` (None for a part not asked for; with `only`
        [b, h, k] bool just those pages, flat [n, P, d]). Only the pages' bytes are read from
        the segment files, each unit checked. None where a block cannot be read so (a
        coded store, a record recovered from disk, pages not whole units, a missing block): the
        caller then reads whole blocks with `get`."""
        core = self._core
        assert isinstance(core, DiskCore)
        b, h, k = blocks.shape
        heads = torch.arange(b * h).view(b, h, 1).expand(b, h, k)  # row * h + KV head of each page
        blk, sub = blocks.cpu(), within.cpu()
        if only is not None:
            keep = only.cpu()
            blk, sub, heads = blk[keep], sub[keep], heads[keep]
        blk, sub, heads = blk.reshape(-1), sub.reshape(-1), heads.reshape(-1)
        ids = torch.unique(blk).tolist()
        layouts = {core.layout((int(layer_idx), j)) for j in ids}
        if len(layouts) != 1 or None in layouts:
            return None  # a block that cannot be read by pages, or blocks of different shapes
        shape, dtype = next(iter(layouts))  # type: ignore[misc]
        B, d = shape[2], shape[3]
        U = core.unit_tokens
        nb = unit_bytes(shape, dtype.itemsize, U)
        if nb is None or B % pages_per_block or (B // pages_per_block) % U or tuple(shape[:2]) != (b, h):
            return None
        P = B // pages_per_block
        per_page = P // U
        parts = [i for i, want in enumerate((keys, values)) if want]
        part_units = b * h * B // U  # V's units follow K's in the payload
        first = (heads * B + sub * P) // U  # [n] each page's first unit in K
        # every unit wanted, keyed by (block, unit): sorted, so each block's units are one slice
        want = (first[None] + torch.tensor(parts)[:, None] * part_units)[..., None] + torch.arange(per_page)
        key = blk[None, :, None] * (2 * part_units) + want  # [parts, n, per]
        uniq, inverse = torch.unique(key.reshape(-1), return_inverse=True)
        owner, units = uniq // (2 * part_units), (uniq % (2 * part_units)).numpy()
        cuts = torch.searchsorted(owner, torch.tensor(ids + [ids[-1] + 1])).tolist()
        # each unit asked for once (a page is not asked twice): read straight into its place in
        # the result, so a read holds one buffer of the pages' bytes, not that and a gathered copy
        once = uniq.numel() == inverse.numel()
        data = torch.empty(inverse.numel() if once else uniq.numel(), nb, dtype=torch.uint8)
        place = torch.empty_like(inverse).scatter_(0, inverse, torch.arange(inverse.numel())) if once else None
        rows = np.arange(uniq.numel()) if place is None else place.numpy()
        if not core.read_units([(int(layer_idx), j) for j in ids], cuts, units, nb, data.numpy(), rows):
            return None  # a block left the store or was replaced since `layout`
        pieces = (data if once else data[inverse]).view(len(parts), blk.numel(), per_page * nb)
        res = [pieces[i].view(dtype).view(-1, P, d) for i in range(len(parts))]
        if only is None:
            res = [t.view(b, h, k, P, d) for t in res]
        it = iter([t.to(device) for t in res])
        return (next(it) if keys else None), (next(it) if values else None)
