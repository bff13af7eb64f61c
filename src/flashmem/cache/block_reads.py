"""Block reads: how a layer gets sealed blocks' exact K/V back from the cold tier.

One room for every path a read can take (docs/design.md, "Data flow", step 3):
- through the Prefetcher, when there is one (a hit if look-ahead loaded the block
  already, else a miss whose wait is stall time);
- straight from the store, a synchronous read counted as a miss and stall;
- a memory store's arena on the compute device, pages of many blocks in one
  `index_select` (`gather_pages`), or every block's keys in place (`block_keys`);
- decoded from low-rank coefficients (`cold_low_rank`, `LatentKV`) after any of them.

It also queues look-ahead loads for the next step and counts the bytes each read
moves (`Traffic`). Tensor shapes: a block is [b, h, B, d]; pages [b, h, k, P, d].
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from flashmem.cache.lookahead import predict_next_blocks
from flashmem.cache.traffic import Traffic
from flashmem.config import FlashMemoryConfig
from flashmem.store.base import ColdStore
from flashmem.store.memory import cut_rows, page_rows
from flashmem.store.prefetch import Prefetcher

if TYPE_CHECKING:
    from flashmem.cache.latent import LatentKV


# Pages read from a store that cuts them out of blocks (`BlockReader.arena_pages`) for a step
# whose reads are large (the re-rank's candidates' keys, cache/ranking.py; an int8 working set's
# new pages, cache/working_set.py) are read at most this many bytes at a time on a CPU whose cold
# tier is off RAM: there they are the process's RAM beside a budget of tens of MB (SmolLM2 at 8K
# and 1/8 with a disk tier: every page a re-rank candidate, 6.3 MB of fp32 keys a layer, against a
# 47 MB budget; docs/results.md, stop 67). With an accelerator, READ_CHUNK_BYTES_ACCELERATOR.
READ_CHUNK_BYTES = 1 << 20
READ_CHUNK_BYTES_ACCELERATOR = 64 << 20


class BlockReader:
    """A layer's reads from its cold tier, with the counters of synchronous reads.

    prefetcher: reads go through it and look-ahead fills it (None: reads go to the
    store); fetch_counts: {"misses", "stall_s"} of synchronous reads, shared by the
    cache's layers; lookahead_bytes: this layer's share of the prefetcher's ready
    buffer, which caps look-ahead requests; traffic: the cache's byte counters.
    """

    # A step's missing blocks are queued to the prefetcher together, so its threads read them
    # in parallel instead of one synchronous read at a time (docs/measurements.md, "Scale").
    demand_batch: bool = True
    # Re-rank candidates are scored where a host-memory cold tier holds their keys, and only
    # the chosen pages cross to the device (`host_ranking`). On by itself when the compute
    # device is not the CPU; True forces it on a CPU too (tests of that path).
    rank_on_host: bool | None = None

    def __init__(
        self,
        layer_idx: int,
        cfg: FlashMemoryConfig,
        store: ColdStore,
        *,
        prefetcher: Prefetcher | None = None,
        fetch_counts: dict[str, float] | None = None,
        lookahead_bytes: int | None = None,
        traffic: Traffic | None = None,
    ) -> None:
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.store = store
        self.prefetcher = prefetcher
        self.fetch_counts = fetch_counts
        self.lookahead_bytes = lookahead_bytes
        self.traffic = traffic if traffic is not None else Traffic()
        # cold_low_rank: blocks are stored as coefficients, decoded on every read (set by the cache)
        self.latent: LatentKV | None = None
        self.device: torch.device = torch.device("cpu")
        self.dtype: torch.dtype = torch.float32
        self.block_start = 0  # position of the first sealed token (the sinks come before)
        self._block_bytes: int | None = None
        self._shape: tuple[int, int, int] = (1, 1, 1)  # b, h, d of the layer's K/V

    def bind(self, shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype, block_start: int) -> None:
        """The layer's geometry for a new sequence: (b, h, d), device, dtype, first sealed position."""
        self._shape, self.device, self.dtype, self.block_start = shape, device, dtype, block_start
        self._block_bytes = None

    @property
    def host_ranking(self) -> bool:
        """Candidates are scored on the host, next to their keys, when the device is another one
        (or `rank_on_host`): in place in a memory store's arena, or in blocks read into host
        memory (a disk store, or through the prefetcher, which then stages blocks on the host).
        Then a step moves query rows and page ids across the link, and the chosen pages, cut on
        the host: not the candidates' keys (1 GiB a step at 128K for Llama-3.1-8B's shape at
        1/16) nor whole blocks. Not with a low-rank cold tier (its pages decode on the device)."""
        if self.latent is not None:
            return False
        return self.device.type != "cpu" if self.rank_on_host is None else self.rank_on_host

    def read_chunk_bytes(self) -> int | None:
        """The most bytes a large read of pages takes at a time (`READ_CHUNK_BYTES` on a CPU with
        a cold tier off RAM, `READ_CHUNK_BYTES_ACCELERATOR` with an accelerator); None: no
        bound, on a CPU whose cold tier lies in the same RAM, where a read's copy is small beside
        it and chunks would only add calls."""
        if self.device.type != "cpu":
            return READ_CHUNK_BYTES_ACCELERATOR
        return READ_CHUNK_BYTES if self.cfg.cold_store != "memory" else None

    def decode_kv_bytes(self) -> int:
        """A decode step's bound on the keys and values it decodes at once (`assembly.decode_kv_bytes`:
        smaller on a CPU whose cold tier is off RAM, where the buffers are the RAM it saves)."""
        from flashmem.cache import assembly  # deferred: assembly imports the working set, which imports this

        return assembly.decode_kv_bytes(self.device, cold_in_ram=self.cfg.cold_store == "memory")

    @property
    def head_dim(self) -> int:
        """d of the layer's K/V as reads hand them over (decoded, with a low-rank tier)."""
        return self._shape[2]

    @property
    def direct(self) -> bool:
        """Reads go straight to the store (no prefetcher): the arena paths may be used."""
        return self.prefetcher is None

    # ------------------------------------------------------------------ whole blocks
    def fetch_block(self, block_idx: int, on_host: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact (or codec-decoded) K/V of a sealed block on the layer's device, [b, h, B, d] each;
        on_host: left in host memory (read by host compute, nothing copied to the device)."""
        key = (self.layer_idx, int(block_idx))
        where = torch.device("cpu") if on_host else self.device
        pf = self.prefetcher
        if pf is not None:
            out = pf.get(key, where)
        else:
            t0 = time.perf_counter()
            out = self.store.get(key, where)
            self._count_sync(1, t0)
        self.traffic.cold_read(self.store, self.device, self._coded_bytes(out[0]), in_place=on_host)
        if self.latent is not None:  # coefficients -> K/V, keys rotated at their positions
            out = self.latent.decode_block(*out, self.block_start + int(block_idx) * self.cfg.hca_chunk_size)
        return out

    def pages_of_blocks(
        self, idx: torch.Tensor, need: torch.Tensor, only: torch.Tensor | None = None, on_host: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the blocks `need` (sorted ids) once each and cut pages idx [b, h, k] out of
        them -> k, v [b, h, k, P, d] (pages of blocks not in `need`: arbitrary rows); with
        `only` [b, h, k] bool just those pages, flat [n, P, d]. on_host: the blocks are read
        and cut in host memory and the pages left there (`to_device` copies what is kept)."""
        ppb = self.cfg.pages_per_block
        need_ids = need.tolist()
        if self.prefetcher is not None and self.demand_batch:
            # Queue every block this step needs before waiting for the first: the loader
            # threads then read them in parallel (already ready or in flight: skipped).
            self.prefetcher.request([(self.layer_idx, j) for j in need_ids], urgent=True)
        blocks = [self.fetch_block(j, on_host) for j in need_ids]
        pool_k = torch.stack([bk for bk, _ in blocks])  # [u, b, h, B, d]
        pool_v = torch.stack([bv for _, bv in blocks])
        where = pool_k.device
        slot = torch.searchsorted(need.to(where), (idx // ppb).to(where)).clamp_max(len(need_ids) - 1)  # [b, h, k]
        sub, keep = (idx % ppb).to(where), None if only is None else only.to(where)
        rows, P = page_rows(pool_k, slot, sub, ppb, keep), pool_k.shape[-2] // ppb  # K's and V's
        flat = keep is not None
        return cut_rows(pool_k, rows, P, slot.shape, flat), cut_rows(pool_v, rows, P, slot.shape, flat)

    def to_device(self, t: torch.Tensor, from_host: bool = True) -> torch.Tensor:
        """Pages cut on the host (`pages_of_blocks(on_host=True)`) copied to the layer's device
        and counted as crossing the link (on a CPU the same RAM: counted, as the copies
        `fetch_block` makes are); from_host False: already on the device and counted, as is."""
        if not from_host:
            return t
        self.traffic.add("h2d_bytes", t.nbytes)
        return t.to(self.device, non_blocking=t.is_pinned())

    # ------------------------------------------------------------------ runs of blocks
    def stream_runs(self, num_sealed: int, run_blocks: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Every sealed block, in runs of `run_blocks` consecutive blocks: (start, stop, k, v)
        with k, v [b, h, (stop-start)*B, d] on the device, each run dropped by the caller
        before the next but one is read. A memory store hands a run over as one contiguous
        host slice (pinned with a GPU): on CUDA the next run's copy is issued on a copy stream
        before the current one is used, so the link works while attention does. Otherwise the
        blocks are read one by one (through the prefetcher, the run queued as urgent)."""
        cuda = self.device.type == "cuda"
        copy_stream = torch.cuda.Stream(self.device) if cuda else None

        def issue(j0: int) -> tuple[int, int, tuple[torch.Tensor, torch.Tensor], torch.cuda.Event | None]:
            j1 = min(num_sealed, j0 + run_blocks)
            host = None if not self.direct or self.latent is not None else self.store.block_run(self.layer_idx, j0, j1)
            if host is None:
                return j0, j1, self._read_blocks(j0, j1), None
            self._count_sync(j1 - j0, time.perf_counter())
            self.traffic.cold_read(self.store, self.device, 2 * host[0].nbytes)
            if copy_stream is None:
                return j0, j1, _as_tokens(*host, self.device), None
            with torch.cuda.stream(copy_stream):
                kv = _as_tokens(*host, self.device)
                done = torch.cuda.Event()
                done.record(copy_stream)
            return j0, j1, kv, done

        pending = issue(0) if num_sealed > 0 else None
        while pending is not None:
            j0, j1, (k, v), done = pending
            pending = issue(j1) if j1 < num_sealed else None  # the next run's copy starts now
            if done is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(done)
                k.record_stream(current)  # made on the copy stream, used on this one
                v.record_stream(current)
            yield j0, j1, k, v

    def _read_blocks(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks start..stop-1 read one by one -> k, v [b, h, n*B, d] on the device."""
        if self.prefetcher is not None and self.demand_batch:
            self.prefetcher.request([(self.layer_idx, j) for j in range(start, stop)], urgent=True)
        blocks = [self.fetch_block(j) for j in range(start, stop)]
        return torch.cat([bk for bk, _ in blocks], dim=-2), torch.cat([bv for _, bv in blocks], dim=-2)

    # ------------------------------------------------------------------ the arena
    def arena_pages(
        self,
        idx: torch.Tensor,
        keys: bool = True,
        values: bool = True,
        only: torch.Tensor | None = None,
        on_host: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """Pages idx [b, h, k] from the store's `gather_pages` (k, v [b, h, k, P, d], a part
        not asked for None; with `only` [b, h, k] bool just those, flat [n, P, d]), counted
        as synchronous reads (one per block touched, as fetch_block counts); None without a
        prefetcher-free path (on_host: with one too) or when the store declines. on_host: left
        where the store holds them (read by host compute, nothing copied to the device). The pages arrive as one
        contiguous buffer: one copy across the link, not one per 16-token page."""
        if self.prefetcher is not None and not on_host:  # device reads go through the prefetcher
            return None
        ppb = self.cfg.pages_per_block
        lat = self.latent
        if lat is not None and only is not None:  # latent pages decode by their [b, h, k] positions
            return None
        slots = (keys, values) if lat is None else lat.slots(keys, values)  # store slots holding them
        t0 = time.perf_counter()
        where = "cpu" if on_host else self.device
        # the page ids go to the host once (the stores cut pages by them there); the blocks touched
        # are counted there too, not by a `unique` the host would wait on the device for
        idx_h = idx.cpu()
        blk, sub = idx_h // ppb, idx_h % ppb
        only_h = None if only is None else only.cpu()
        got = self.store.gather_pages(self.layer_idx, blk, sub, ppb, where, *slots, only=only_h)
        if got is not None:
            self._count_sync(int(torch.unique(blk if only_h is None else blk[only_h]).numel()), t0)
            nbytes = sum(t.nbytes for t in got if t is not None)
            self.traffic.cold_read(self.store, self.device, nbytes, in_place=on_host)
        if got is not None and lat is not None:  # coefficients -> K/V, keys rotated at their positions
            got = lat.decode_pages(got[0], got[1], idx, self.block_start, keys, values)
        return got

    def block_keys(self, num_sealed: int) -> torch.Tensor | None:
        """Every sealed block's keys where the store holds them ([n, b, h, B, d], read-only, no
        copy): on the compute device, or on the host with `host_ranking`; None where it
        cannot (a prefetcher unless ranked on the host, a latent tier, coded blocks, another
        device). Counted as a read
        of every block by compute where they lie."""
        if self.latent is not None or (self.prefetcher is not None and not self.host_ranking):
            return None
        t0 = time.perf_counter()
        keys = self.store.block_keys(self.layer_idx, num_sealed, "cpu" if self.host_ranking else self.device)
        if keys is not None:
            self._count_sync(num_sealed, t0)
            self.traffic.cold_read(self.store, self.device, keys.nbytes, in_place=True)
        return keys

    # ------------------------------------------------------------------ look-ahead
    def look_ahead(self, pages: torch.Tensor, num_sealed: int) -> None:
        """Queue background loads of the blocks predicted for the next step: the blocks of this
        step's pages [b, h, k] and neighbours within prefetch_window (docs/design.md)."""
        pf = self.prefetcher
        if pf is None or (self.host_ranking and self.store.page_reads):
            return  # nothing to load ahead: ranked on the host, a step takes its pages from the store
        cfg = self.cfg
        blocks = pages // cfg.pages_per_block
        cap = None
        if self.lookahead_bytes is not None:
            cap = max(1, self.lookahead_bytes // self.prefetch_block_bytes())
        ids = predict_next_blocks(blocks, num_sealed, cfg.hca_chunk_size, cfg.prefetch_window, max_blocks=cap)
        pf.request([(self.layer_idx, j) for j in ids])

    def prefetch_block_bytes(self) -> int:
        """Bytes one block takes in the prefetch buffer (coded when the store hands out payloads)."""
        n = self._block_bytes
        if n is None:
            b, h, d = self._shape
            if self.latent is not None:
                d = self.latent.width  # the store's slots hold low-rank coefficients
            shape = (b, h, self.cfg.hca_chunk_size, d)
            if self.store.coded_reads:
                n = int(self.store.codec.nbytes(shape, self.dtype))
            else:
                n = 2 * b * h * self.cfg.hca_chunk_size * d * self.dtype.itemsize
            self._block_bytes = n = max(1, n)
        return n

    def page_bytes(self) -> int:
        """Bytes one page of one row and KV head takes as the cold tier hands it over (K and V)."""
        b, h, _ = self._shape
        return self.prefetch_block_bytes() // max(1, b * h * self.cfg.pages_per_block)

    def _coded_bytes(self, k: torch.Tensor) -> int:
        """Bytes a block with keys like k [b, h, B, d] takes as the cold tier hands it over (K and V)."""
        codec = self.store.codec
        if codec.name == "exact":
            return 2 * k.nbytes
        return int(codec.nbytes(tuple(k.shape), k.dtype))  # type: ignore[arg-type]

    def _count_sync(self, blocks: int, t0: float) -> None:
        counts = self.fetch_counts
        if counts is not None:
            counts["misses"] += blocks
            counts["stall_s"] += time.perf_counter() - t0


def _as_tokens(k: torch.Tensor, v: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of blocks k, v [n, b, h, B, d] (host) -> [b, h, n*B, d] on `device` (one copy each)."""
    n, b, h, B, d = k.shape

    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, non_blocking=t.is_pinned())
        return t.permute(1, 2, 0, 3, 4).reshape(b, h, n * B, d)

    return move(k), move(v)
