"""The disk tier's page reads (DiskStore.gather_pages): the bytes of the pages asked for,
equal to cutting them from whole blocks, each unit (4 tokens, or the cache's page) checked against
sums kept in RAM."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
import torch

from flashmem.errors import ChecksumError
from flashmem.store import DiskStore, MemoryStore
from flashmem.store.format import HEADER_SIZE
from flashmem.store.memory import cut_pages
from flashmem.store.page_sums import unit_sums

SHAPE = (2, 3, 64, 16)  # b, h, B, d: 4 pages of 16 tokens a block
PPB = 4


def block(layer: int, idx: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(layer * 1009 + idx)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)


def pick(seed: int, n_blocks: int, k: int = 5):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, n_blocks, (SHAPE[0], SHAPE[1], k), generator=g)
    within = torch.randint(0, PPB, (SHAPE[0], SHAPE[1], k), generator=g)
    return blocks, within


def expected(layer: int, blocks: torch.Tensor, within: torch.Tensor, dtype, only=None):
    """The pages cut from whole blocks, as the memory arena cuts them."""
    ids = torch.unique(blocks)
    pool_k = torch.stack([block(layer, int(j), dtype)[0] for j in ids])
    pool_v = torch.stack([block(layer, int(j), dtype)[1] for j in ids])
    slot = torch.searchsorted(ids, blocks)
    return cut_pages(pool_k, slot, within, PPB, only), cut_pages(pool_v, slot, within, PPB, only)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("durable", [False, True])
def test_pages_equal_those_cut_from_whole_blocks(tmp_path, dtype, durable):
    with DiskStore(str(tmp_path), dtype=dtype, sync=False) as s:
        for j in range(6):
            s.put((1, j), *block(1, j, dtype))
        if durable:
            s.flush()
            assert s.pending_blocks() == 0
        blocks, within = pick(0, 6)
        read0 = s.stats.bytes_read
        k, v = s.gather_pages(1, blocks, within, PPB, "cpu")
        ek, ev = expected(1, blocks, within, dtype)
        assert torch.equal(k, ek) and torch.equal(v, ev)
        page = SHAPE[2] // PPB * SHAPE[3] * dtype.itemsize
        distinct = len({(int(bb), int(w), r, hh) for (r, hh, _), bb, w in zip(
            np.ndindex(*blocks.shape), blocks.reshape(-1), within.reshape(-1))})  # fmt: skip
        # only the distinct pages' K and V bytes are read from the files (none of a block still
        # pending: the writer may have made some durable already)
        read = s.stats.bytes_read - read0
        assert read == 2 * distinct * page if durable else read <= 2 * distinct * page
        # one part, and `only`: flat, in (b, h, k) order
        only = torch.rand(blocks.shape, generator=torch.Generator().manual_seed(3)) < 0.5
        k1, v1 = s.gather_pages(1, blocks, within, PPB, "cpu", values=False, only=only)
        assert v1 is None and torch.equal(k1, expected(1, blocks, within, dtype, only)[0])


@pytest.mark.parametrize("durable", [False, True])
def test_pages_asked_once_are_read_into_place(tmp_path, durable):
    """Pages asked for once each (a re-rank's sorted candidates: every page of 40 blocks, per row
    and KV head) are read straight into the result: the pages cut from whole blocks, with no
    buffer of the pages' size beside it (numpy's allocations, which tracemalloc sees; before,
    the units were read into one and gathered into the result). Not durable: the writer is held
    back, so every block is read from memory and its commits allocate nothing meanwhile."""
    import threading

    n_blocks = 40
    gate = threading.Event()
    with DiskStore(str(tmp_path), dtype=torch.float32, sync=False) as s:
        if not durable:
            write = s._core._write_batch

            def held_back(batch):  # type: ignore[no-untyped-def]
                gate.wait()
                return write(batch)

            s._core._write_batch = held_back  # type: ignore[method-assign]
        try:
            for j in range(n_blocks):
                s.put((1, j), *block(1, j))
            if durable:
                s.flush()
            ids = torch.arange(n_blocks * PPB).expand(SHAPE[0], SHAPE[1], -1)
            blocks, within = ids // PPB, ids % PPB
            tracemalloc.start()
            try:
                k, v = s.gather_pages(1, blocks, within, PPB, "cpu")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        finally:
            gate.set()
        ek, ev = expected(1, blocks, within, torch.float32)
        assert torch.equal(k, ek) and torch.equal(v, ev)
        assert peak < (k.nbytes + v.nbytes) / 4, (peak, k.nbytes + v.nbytes)


def test_pages_of_pending_and_durable_blocks_read_in_one_call(tmp_path, monkeypatch):
    """One page read over blocks some of which are still pending (served from memory) and some
    durable (read from the files): every page as cut from whole blocks."""
    import threading

    from flashmem.store.disk_core import DiskCore

    with DiskStore(str(tmp_path), dtype=torch.float32, sync=False) as s:
        for j in range(3):
            s.put((1, j), *block(1, j))
        s.flush()
        go = threading.Event()
        write = DiskCore._write_batch

        def held(self, batch):
            go.wait(30)
            return write(self, batch)

        monkeypatch.setattr(DiskCore, "_write_batch", held)
        try:
            for j in range(3, 6):
                s.put((1, j), *block(1, j))
            assert s.pending_blocks() == 3
            blocks, within = pick(7, 6, 8)
            assert bool((blocks < 3).any()) and bool((blocks >= 3).any())
            k, v = s.gather_pages(1, blocks, within, PPB, "cpu")
            ek, ev = expected(1, blocks, within, torch.float32)
            assert torch.equal(k, ek) and torch.equal(v, ev)
        finally:
            go.set()


def test_damaged_page_is_refused_and_others_still_read(tmp_path):
    with DiskStore(str(tmp_path), sync=True) as s:
        for j in range(3):
            s.put((0, j), *block(0, j))
        s.flush()
        seg = os.path.join(s.path, "seg-000000.dat")
        rec = HEADER_SIZE + 2 * int(np.prod(SHAPE)) * 4
        # flip a byte of block 1's K: row 0, head 2, page 3 (tokens 48..63)
        at = rec + HEADER_SIZE + ((0 * 3 + 2) * 64 + 50) * 16 * 4 + 5
        with open(seg, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
        bad_b = torch.tensor([[[1], [1], [1]], [[0], [0], [0]]])
        bad_w = torch.tensor([[[3], [3], [3]], [[0], [0], [0]]])
        with pytest.raises(ChecksumError, match=r"block \(layer 0, block 1\).*page checksum mismatch"):
            s.gather_pages(0, bad_b, bad_w, PPB, "cpu")
        # the same block's other pages, and the other blocks, are intact and read
        ok_w = torch.tensor([[[2], [2], [2]], [[0], [0], [0]]])
        k, _ = s.gather_pages(0, bad_b, ok_w, PPB, "cpu")
        assert torch.equal(k, expected(0, bad_b, ok_w, torch.float32)[0])


def test_no_page_reads_where_the_sums_are_missing(tmp_path):
    """A coded store, a record recovered from disk (its sums are not on disk), or pages that
    are not whole units: None, so the caller reads whole blocks."""
    blocks, within = pick(1, 2, 2)
    with DiskStore(str(tmp_path), codec="int8", sync=False) as s:
        s.put((0, 0), *block(0, 0))
        s.put((0, 1), *block(0, 1))
        assert s.gather_pages(0, blocks, within, PPB, "cpu") is None
    s = DiskStore(str(tmp_path), persist=True, sync=True)
    s.put((0, 0), *block(0, 0))
    s.put((0, 1), *block(0, 1))
    path = s.path
    assert s.gather_pages(0, blocks, within, 32, "cpu") is None  # 2-token pages
    s.close()
    again = DiskStore.reopen(path)
    try:
        assert again.gather_pages(0, blocks, within, PPB, "cpu") is None
        assert torch.equal(again.get((0, 1))[0], block(0, 1)[0])  # whole blocks still read
    finally:
        again.close()
    assert MemoryStore().gather_pages is not None


def test_units_of_a_page_keep_a_quarter_of_the_sums_and_still_catch_damage(tmp_path):
    """A store opened with 16-token units (the cache's page size: `open_disk`) keeps one sum a
    page, a quarter of 4-token units' RAM; its pages read as cut from whole blocks, a damaged
    byte is refused, and pages that are not whole units are not read alone (None)."""
    sums = {}
    for unit in (4, 16):
        with DiskStore(str(tmp_path / str(unit)), sync=True, unit_tokens=unit) as s:
            for j in range(3):
                s.put((0, j), *block(0, j))
            s.flush()
            sums[unit] = 8 * s._core.table.arena.n  # the sums' bytes (uint64)
            blocks, within = pick(4, 3)
            k, v = s.gather_pages(0, blocks, within, PPB, "cpu")
            ek, ev = expected(0, blocks, within, torch.float32)
            assert torch.equal(k, ek) and torch.equal(v, ev)
            if unit == 16:
                assert s.gather_pages(0, blocks, within, 2 * PPB, "cpu") is None  # 8-token pages
                seg = os.path.join(s.path, "seg-000000.dat")
                at = HEADER_SIZE + ((1 * 3 + 0) * 64 + 20) * 16 * 4 + 3  # block 0's K: row 1, head 0, page 1
                with open(seg, "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ 0x01]))
                bad = torch.zeros(2, 3, 1, dtype=torch.long)
                with pytest.raises(ChecksumError, match="page checksum mismatch"):
                    s.gather_pages(0, bad, torch.ones_like(bad), PPB, "cpu")
    assert sums[16] * 4 == sums[4] == 3 * 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] // 4 * 8  # 8 bytes a unit


def test_the_cache_opens_its_disk_tier_with_units_of_its_page(tmp_path):
    import flashmem
    from flashmem.store import open_store

    for page, unit in ((16, 16), (4, 4), (8, 8), (2, 4)):  # 2-token pages: 4-token units, read whole
        cfg = flashmem.FlashMemoryConfig(
            cold_store="disk", cold_dir=str(tmp_path), hca_chunk_size=64, lsa_page_tokens=page, csa_chunk_size=2
        )
        store = open_store(cfg, dtype=torch.float32, name="units")
        try:
            assert store._core.unit_tokens == unit
        finally:
            store.close()


def test_unit_sums_see_a_change_of_any_word():
    g = torch.Generator().manual_seed(0)
    units = torch.randint(0, 256, (4, 256), generator=g, dtype=torch.uint8).numpy()
    base = unit_sums(units)
    for w in range(0, 256, 8):
        changed = units.copy()
        changed[2, w] ^= 1
        got = unit_sums(changed)
        assert got[2] != base[2] and np.array_equal(np.delete(got, 2), np.delete(base, 2))


@pytest.mark.parametrize("threads", [0, 2])
def test_a_decode_step_reads_from_disk_only_the_pages_it_newly_attends(monkeypatch, tmp_path, threads):
    """Ranked on the host (as on an accelerator) over int4 codes kept in RAM, a disk tier's decode
    step reads the new pages' K and V from the files (whole blocks read several times that),
    with the same logits as whole-block reads."""
    import flashmem
    from flashmem.cache.block_reads import BlockReader
    from test_traffic import RERANKED
    from tiny_models import tiny_llama

    monkeypatch.setattr(BlockReader, "rank_on_host", True)
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(6))

    def decode(tag: str) -> tuple[torch.Tensor, int, int]:
        cfg = flashmem.FlashMemoryConfig(
            **{**RERANKED, "prefetch_threads": threads, "lsa_rerank_codec": "int4"},
            cold_store="disk",
            cold_dir=str(tmp_path / tag),
        )
        cache = flashmem.attach(model, cfg)
        out, disk, new_bytes = [], 0, 0
        with torch.no_grad():
            out.append(model(ids[:, :-8], cache=cache, use_cache=True).logits[:, -1])
            for t in range(ids.shape[1] - 8, ids.shape[1]):
                cache.store.flush()  # every record durable: its reads are disk reads
                before = cache.traffic_report()["totals"]["disk_read_bytes"]
                out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
                step = cache.traffic_report()
                disk += step["totals"]["disk_read_bytes"] - before
        new_bytes = sum(s.new_page_bytes for s in cache._traffic.steps if s.kind == "decode")
        cache.close()
        return torch.cat(out), disk, new_bytes

    out, disk, new_bytes = decode("pages")
    monkeypatch.setattr(DiskStore, "gather_pages", lambda self, *a, **k: None)
    ref, disk_blocks, _ = decode("blocks")
    assert torch.equal(out, ref)
    # the pages are all a step reads (with a prefetcher too: it loads no whole block ahead)
    assert new_bytes > 0 and disk == new_bytes
    if threads == 0:  # whole blocks read from the files: several times that (through the
        # prefetcher they come from its RAM buffer instead, which the disk tier is there to save)
        assert disk_blocks > 2 * disk
