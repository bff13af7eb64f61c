"""Host-memory cold tier: blocks kept as CPU tensors (pinned when CUDA is present).

With codec "exact" the block's tensors are kept as they are (a `get` to the
same device returns them without a copy: treat them as read-only). With int8 or
int4 the coded payload is kept (uint8 [nbytes]) and decoded on the target
device on `get`.

Exact blocks of one layer live in one tensor per K and V, `[slots, b, h, B, d]`,
indexed by block id (`_LayerArena`): `gather_pages` then cuts the selected pages
of many blocks in one indexing op, with no per-block Python work (at 1/8 of 32K
tokens a decode step reads pages of ~180 blocks per layer; stacking whole blocks
to cut 16 tokens out of each was most of the step: benchmarks/profile_decode.py).
"""

from __future__ import annotations

import threading

import torch

from flashmem.errors import ColdStoreError
from flashmem.store.base import BlockKey, ColdStore, StoreStats
from flashmem.store.codecs import get_codec
from flashmem.store.codecs.base import check_pair
from flashmem.store.transfer import ensure_host, pinning, to_device, to_host


def cut_pages(
    pool: torch.Tensor,
    slot: torch.Tensor,
    within: torch.Tensor,
    pages_per_block: int,
    only: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pages out of a pool of blocks in one op: pool [u, b, h, B, d] (blocks stacked, or a
    layer's arena), slot / within [b, h, k] (block in the pool, page in the block)
    -> [b, h, k, P, d]; with `only` [b, h, k] bool just those pages, flat: [n, P, d] in
    (b, h, k) order. The pool seen as [pages, P*d] rows gives one index_select (a
    memcpy per page) instead of a four-tensor advanced index."""
    P = pool.shape[-2] // pages_per_block
    return cut_rows(pool, page_rows(pool, slot, within, pages_per_block, only), P, slot.shape, only is not None)


def page_rows(
    pool: torch.Tensor, slot: torch.Tensor, within: torch.Tensor, pages_per_block: int, only: torch.Tensor | None
) -> torch.Tensor:
    """`cut_pages`' rows of the pool seen as [pages, P*d], on the pool's device: the same for
    every pool of that shape (a layer's K and V arenas), so made once for both."""
    _, b, h, _, _ = pool.shape
    # ((slot * b + row) * h + head) * pages_per_block + within, with (row * h + head) one arange
    heads = torch.arange(b * h, device=slot.device).view(b, h, 1) * pages_per_block
    rows = (slot * (b * h * pages_per_block) + heads + within).reshape(-1)
    if only is not None:
        rows = rows[only.reshape(-1).to(rows.device)]
    return rows.to(pool.device)


def cut_rows(pool: torch.Tensor, rows: torch.Tensor, P: int, shape: torch.Size, flat: bool) -> torch.Tensor:
    """Pages `rows` (`page_rows`) of pool [u, b, h, B, d], P tokens each -> [n, P, d] (flat:
    `only`'s pages) or [*shape, P, d] (shape: the page ids' [b, h, k])."""
    d = pool.shape[-1]
    out = pool.view(-1, P * d).index_select(0, rows)
    return out.view(-1, P, d) if flat else out.view(*shape, P, d)


class _LayerArena:
    """One layer's exact blocks: k, v [slots, b, h, B, d], slot = block id.

    Grows by a quarter (at least 64 slots) when a block id lies past the end, and the
    store points its blocks into the grown arena; a reader keeps the tensors it took, so
    growing never invalidates a read in flight.
    """

    def __init__(self, k: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(k.shape), k.dtype
        self.k = self.v = torch.empty((0, *self.shape), dtype=k.dtype, pin_memory=pinning())
        self.present = torch.zeros(0, dtype=torch.bool)

    def fits(self, k: torch.Tensor) -> bool:
        return tuple(k.shape) == self.shape and k.dtype == self.dtype

    def write(self, j: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Copy block j in -> whether the arena grew (its earlier blocks moved)."""
        n = self.k.shape[0]
        grew = j >= n
        if grew:
            cap = max(j + 1, n + max(64, n // 4))
            grown = [torch.empty((cap, *self.shape), dtype=self.dtype, pin_memory=pinning()) for _ in range(2)]
            grown[0][:n], grown[1][:n] = self.k, self.v
            present = torch.zeros(cap, dtype=torch.bool)
            present[:n] = self.present
            self.k, self.v, self.present = grown[0], grown[1], present
        self.k[j].copy_(k.detach())
        self.v[j].copy_(v.detach())
        self.present[j] = True
        return grew


class MemoryStore(ColdStore):
    tier = "memory"

    def __init__(self, codec: str = "exact") -> None:
        self.codec = get_codec(codec)
        # exact: key -> (k, v) (views of the layer's arena when the block fits it);
        # coded: key -> (payload uint8 [n], shape, dtype)
        self._blocks: dict[BlockKey, tuple] = {}
        self._arenas: dict[int, _LayerArena] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.stats = StoreStats()

    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = check_pair(k, v)
        payload = None if self.codec.name == "exact" else ensure_host(self.codec.encode(k.detach(), v.detach()))
        with self._lock:
            self._check_open("put")
            if payload is not None:
                entry: tuple = (payload, shape, k.dtype)
                n = payload.numel()
            else:
                entry, n = self._put_exact(key, k, v), 2 * k.numel() * k.element_size()
            old = self._blocks.get(key)
            if old is not None:
                self._bytes -= self._entry_bytes(old)
            self._blocks[key] = entry
            self._bytes += n
            self.stats.puts += 1
            self.stats.bytes_written += n

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            self._check_open("get")
            entry = self._blocks[key]
            self.stats.gets += 1
            self.stats.bytes_read += self._entry_bytes(entry)
        if self.codec.name == "exact":
            k, v = entry
            return to_device(k, device), to_device(v, device)
        payload, shape, dtype = entry
        return self.codec.decode(to_device(payload, device), shape, dtype)

    def _put_exact(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy an exact block into its layer's arena (the first block fixes the
        arena's shape; one of another shape is kept on its own, outside it)."""
        layer, j = int(key[0]), int(key[1])
        arena = self._arenas.get(layer)
        if arena is None:
            arena = self._arenas[layer] = _LayerArena(k)
        if j < 0 or not arena.fits(k):
            old = self._blocks.get(key)
            if old is not None and arena.fits(old[0]) and j >= 0:
                arena.present[j] = False  # the arena's copy is stale now
            return to_host(k), to_host(v)
        if arena.write(j, k, v):
            # the layer's blocks point into the grown arena: a view of the old one would keep
            # every earlier arena alive (a quarter more each time: about 5x the blocks' bytes)
            present = arena.present.tolist()
            for other in self._blocks:
                i = int(other[1])
                if int(other[0]) == layer and 0 <= i < len(present) and present[i] and i != j:
                    self._blocks[other] = (arena.k[i], arena.v[i])
        return arena.k[j], arena.v[j]

    @property
    def page_reads(self) -> bool:
        return self.codec.name == "exact"  # exact blocks live in the arena that pages are cut from

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
        """Pages cut out of many blocks in one op: blocks, within: [b, h, k] (block id
        and page within it, per row and KV head) -> k, v [b, h, k, P, d] on `device`
        (None for a part not asked for; with `only` [b, h, k] bool just those pages,
        flat [n, P, d]). None when this store cannot (coded blocks, or a block outside
        the layer's arena): the caller then reads whole blocks with `get`."""
        got = self._arena(layer_idx)
        if got is None:
            return None
        ak, av, present = got
        flat = (blocks if only is None else blocks[only]).reshape(-1).cpu()
        if flat.numel() == 0 or int(flat.max()) >= present.numel() or not bool(present[flat].all()):
            return None
        _, ab, ah, B, _ = ak.shape
        if (ab, ah) != tuple(blocks.shape[:2]) or B % pages_per_block:
            return None
        slot, wi = blocks.cpu(), within.cpu()
        rows = page_rows(ak, slot, wi, pages_per_block, None if only is None else only.cpu())  # K's and V's
        parts = [
            cut_rows(t, rows, B // pages_per_block, slot.shape, only is not None) if want else None
            for t, want in ((ak, keys), (av, values))
        ]
        with self._lock:
            self.stats.gets += 1
            self.stats.bytes_read += sum(t.numel() * t.element_size() for t in parts if t is not None)
        out_k, out_v = (None if t is None else to_device(t, device) for t in parts)
        return out_k, out_v

    def block_keys(self, layer_idx: int, n: int, device: torch.device | str) -> torch.Tensor | None:
        """The keys of blocks 0..n-1 of a layer as the arena holds them, [n, b, h, B, d],
        no copy (read-only), or None: coded blocks, a block missing from the arena, or an
        arena on another device than `device`."""
        got = self._arena(layer_idx)
        if got is None or n <= 0 or n > got[2].numel() or not bool(got[2][:n].all()):
            return None
        keys = got[0][:n]
        if keys.device != torch.device(device):
            return None
        with self._lock:
            self.stats.gets += 1
            self.stats.bytes_read += keys.numel() * keys.element_size()
        return keys

    def block_run(self, layer_idx: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Blocks start..stop-1 of a layer as the arena holds them (host memory, pinned when a
        GPU is present): k, v [n, b, h, B, d] views, no copy (read-only); None where a block is
        missing from the arena or the blocks are coded."""
        got = self._arena(layer_idx)
        if got is None or not 0 <= start < stop <= got[2].numel() or not bool(got[2][start:stop].all()):
            return None
        k, v = got[0][start:stop], got[1][start:stop]
        with self._lock:
            self.stats.gets += 1
            self.stats.bytes_read += 2 * k.numel() * k.element_size()
        return k, v

    def _arena(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A layer's arena tensors k, v [slots, b, h, B, d] and present [slots], taken together
        under the lock (a put growing the arena swaps all three), or None (coded blocks)."""
        if self.codec.name != "exact":
            return None
        with self._lock:
            self._check_open("get")
            arena = self._arenas.get(int(layer_idx))
            return None if arena is None else (arena.k, arena.v, arena.present)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._blocks)

    def nbytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        """Drop every block; any later put or get is a one-line ColdStoreError."""
        with self._lock:
            self._closed = True
            self._blocks.clear()
            self._arenas.clear()
            self._bytes = 0

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ColdStoreError(f"cold store (memory): {what} after close; allowed: a new store")

    def _entry_bytes(self, entry: tuple) -> int:
        if self.codec.name == "exact":
            k, v = entry
            return 2 * k.numel() * k.element_size()
        return int(entry[0].numel())
