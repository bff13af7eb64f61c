"""Disk, layered and memory cold stores: put/get, durability, lifecycle, factory."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from flashmem.config import FlashMemoryConfig
from flashmem.sizing.tiers import codec_bytes_per_element
from flashmem.store import DiskStore, LayeredStore, MemoryStore, open_store
from flashmem.store.lmdb_store import LmdbStore

SHAPE = (1, 2, 64, 32)


def block(layer: int, idx: int, dtype=torch.float32, shape=SHAPE):
    g = torch.Generator().manual_seed(layer * 100003 + idx)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_round_trip_before_and_after_flush(tmp_path, dtype):
    with DiskStore(str(tmp_path), dtype=dtype) as s:
        for i in range(12):
            s.put((3, i), *block(3, i, dtype))
        k, v = s.get((3, 4), "cpu")  # maybe still pending: served from memory
        assert same(k, block(3, 4, dtype)[0]) and same(v, block(3, 4, dtype)[1])
        s.flush()
        assert s.pending_blocks() == 0
        for i in range(12):
            k, v = s.get((3, i))
            assert same(k, block(3, i, dtype)[0]) and same(v, block(3, i, dtype)[1])
        assert (3, 11) in s and (3, 12) not in s and (4, 0) not in s
        assert s.nbytes() == 12 * 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] * dtype.itemsize
        assert s.stats.puts == 12 and s.stats.bytes_read > 0 and s.stats.bytes_written > 0
        with pytest.raises(KeyError):
            s.get((9, 9))


def test_returned_tensors_do_not_alias_the_store(tmp_path):
    with DiskStore(str(tmp_path), sync=False) as s:
        s.put((0, 0), *block(0, 0))
        k, _ = s.get((0, 0))
        k.zero_()  # pending path: must not damage the stored copy
        s.flush()
        assert same(s.get((0, 0))[0], block(0, 0)[0])


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_disk_codec_bytes(tmp_path, codec):
    with DiskStore(str(tmp_path), codec=codec, dtype=torch.float16) as s:
        for i in range(4):
            s.put((0, i), *block(0, i, torch.float16))
        s.flush()
        per_block = codec_bytes_per_element(codec, 2) * 2 * torch.Size(SHAPE).numel()
        assert s.nbytes() == 4 * per_block
        k, v = s.get((0, 2))
        assert k.dtype == torch.float16 and k.shape == SHAPE
        assert (k.float() - block(0, 2, torch.float16)[0].float()).abs().max() < 0.5


def test_close_removes_folder_unless_persist(tmp_path):
    s = DiskStore(str(tmp_path))
    s.put((0, 0), *block(0, 0))
    path = s.path
    assert os.path.isdir(path) and os.path.dirname(path) == str(tmp_path)
    s.close()
    assert not os.path.exists(path)
    s.close()  # idempotent

    with DiskStore(str(tmp_path), persist=True) as p:
        p.put((0, 0), *block(0, 0))
        path = p.path
    assert os.path.isdir(path)  # persisted, and every put was made durable by close
    r = DiskStore.reopen(path, persist=False)
    assert r.recovered["kept"] == 1 and same(r.get((0, 0))[0], block(0, 0)[0])
    r.close()
    assert not os.path.exists(path)


def test_garbage_collection_removes_folder(tmp_path):
    s = DiskStore(str(tmp_path))
    s.put((0, 0), *block(0, 0))
    path = s.path
    del s
    gc.collect()
    assert not os.path.exists(path)


def test_reopen_appends_to_a_new_segment(tmp_path):
    with DiskStore(str(tmp_path), persist=True, codec="int8") as s:
        for i in range(3):
            s.put((1, i), *block(1, i))
        path = s.path
        want = {i: s.get((1, i)) for i in range(3)}
    with DiskStore.reopen(path) as r:
        for i in range(3, 6):
            r.put((1, i), *block(1, i))
        want.update({i: r.get((1, i)) for i in range(3, 6)})
    with DiskStore.reopen(path, persist=False, verify=True) as r:
        assert r.codec.name == "int8" and len(r) == 6 and r.recovered["dropped"] == 0
        for i in range(6):
            k, v = r.get((1, i))
            assert same(k, want[i][0]) and same(v, want[i][1])


def test_segments_roll(tmp_path):
    with DiskStore(str(tmp_path), segment_bytes=40_000, sync=False) as s:
        for i in range(8):
            s.put((0, i), *block(0, i))
        s.flush()
        segs = [n for n in os.listdir(s.path) if n.startswith("seg-")]
        assert len(segs) >= 4
        for i in range(8):
            assert same(s.get((0, i))[0], block(0, i)[0])


def test_layered_lru_and_tier_stats(tmp_path):
    one = 2 * torch.Size(SHAPE).numel() * 4
    disk = DiskStore(str(tmp_path), dtype=torch.float32)
    with LayeredStore(disk, ram_bytes=3 * one) as s:
        for i in range(6):
            s.put((0, i), *block(0, i))
        s.flush()
        assert s.ram_nbytes() == 3 * one  # the newest 3 blocks
        assert same(s.get((0, 5))[0], block(0, 5)[0])  # RAM hit
        assert same(s.get((0, 0))[0], block(0, 0)[0])  # disk read, now in RAM
        assert same(s.get((0, 0))[1], block(0, 0)[1])  # RAM hit
        t = s.tier_stats()
        assert t["ram"]["hits"] == 2 and t["ram"]["misses"] == 1
        assert t["disk"]["bytes_read"] >= one and t["disk"]["bytes_written"] >= 6 * one
        k, _ = s.get((0, 5))
        k.zero_()
        assert same(s.get((0, 5))[0], block(0, 5)[0])  # RAM copy not aliased


def test_memory_store_with_codec():
    s = MemoryStore(codec="int4")
    s.put((0, 0), *block(0, 0, torch.float16))
    assert s.nbytes() == codec_bytes_per_element("int4", 2) * 2 * torch.Size(SHAPE).numel()
    k, v = s.get((0, 0), "cpu")
    assert k.dtype == torch.float16 and (k.float() - block(0, 0, torch.float16)[0].float()).abs().max() < 1.0
    e = MemoryStore()
    e.put((0, 0), *block(0, 0))
    assert same(e.get((0, 0))[0], block(0, 0)[0]) and e.nbytes() == 2 * torch.Size(SHAPE).numel() * 4


@pytest.mark.parametrize(
    "kind,cls", [("memory", MemoryStore), ("disk", DiskStore), ("layered", LayeredStore), ("lmdb", LmdbStore)]
)
def test_open_store_factory(tmp_path, kind, cls):
    cold_dir = None if kind == "memory" else str(tmp_path)  # a memory store keeps no files
    cfg = FlashMemoryConfig(cold_store=kind, cold_dir=cold_dir, cold_codec="int8", cold_ram_bytes=10**6)
    with open_store(cfg, dtype=torch.bfloat16, name="layer cache/0") as s:
        assert isinstance(s, cls) and s.codec.name == "int8"
        s.put((0, 0), *block(0, 0, torch.bfloat16))
        s.flush()
        k, v = s.get((0, 0), torch.device("cpu"))
        assert k.dtype == torch.bfloat16 and k.shape == SHAPE
        if kind != "memory":
            assert os.path.basename(s.path).startswith("layer_cache_0-")


def test_sweep_stale_removes_only_dead_unpersisted_folders(tmp_path):
    import json
    import subprocess
    import sys

    from flashmem.store.stale import sweep_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = DiskStore(str(tmp_path))  # this process: kept
    kept = DiskStore(str(tmp_path), persist=True)
    stale = DiskStore(str(tmp_path), persist=True)
    for s, persist in ((kept, True), (stale, False)):
        meta = os.path.join(s.path, "meta.json")
        with open(meta) as f:
            m = json.load(f)
        m.update(pid=dead_pid, persist=persist)
        with open(meta, "w") as f:
            json.dump(m, f)
    stale_path, kept_path = stale.path, kept.path
    assert sweep_stale(str(tmp_path)) == [stale_path]
    assert os.path.isdir(live.path) and os.path.isdir(kept_path) and not os.path.exists(stale_path)
    for s in (live, kept, stale):
        s._core.persist = False
        s.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["exact", "int8", "int4"])
def test_cuda_round_trip(tmp_path, codec):
    """On CUDA: put from the device, get back on the device (pinned host buffers, async copies)."""
    from flashmem.store import Prefetcher

    k, v = (t.cuda() for t in block(0, 0, torch.bfloat16))
    for s in (
        MemoryStore(codec=codec),
        DiskStore(str(tmp_path), codec=codec, dtype=torch.bfloat16),
        LayeredStore(DiskStore(str(tmp_path), codec=codec, dtype=torch.bfloat16), ram_bytes=1 << 20),
    ):
        with s:
            s.put((0, 0), k, v)
            s.flush()
            k2, v2 = s.get((0, 0), "cuda")
            assert k2.is_cuda and k2.dtype == torch.bfloat16
            ref = s.get((0, 0), "cpu")
            assert torch.equal(k2.cpu(), ref[0]) and torch.equal(v2.cpu(), ref[1])
            if codec == "exact":
                assert torch.equal(k2, k) and torch.equal(v2, v)
            with Prefetcher(s, 1) as pf:
                pf.request([(0, 0)])
                assert torch.equal(pf.get((0, 0), "cuda")[0].cpu(), ref[0])


def test_close_from_the_writer_thread_is_deferred(tmp_path):
    """GC may run the finalizer on the writer thread itself: it must not join itself
    or close files under its own feet."""
    s = DiskStore(str(tmp_path))
    core = s._core
    real = core._write_batch

    def write_then_close(batch):
        out = real(batch)
        core.close()  # as a finalizer would, mid-loop on the writer thread
        return out

    core._write_batch = write_then_close
    s.put((0, 0), *block(0, 0))
    core.thread.join(timeout=10)
    assert not core.thread.is_alive() and core.closed and not os.path.exists(core.folder)


def test_cold_pending_mb_bounds_the_disk_tiers_write_behind(tmp_path):
    """`cold_pending_mb` reaches the disk and LMDB tiers as their write-behind bound."""
    import flashmem
    from flashmem.store import open_disk

    cfg = flashmem.FlashMemoryConfig(cold_store="disk", cold_dir=str(tmp_path), cold_pending_mb=3)
    store = open_disk(cfg, dtype=torch.float32, name="t")
    try:
        assert store._core.max_pending_bytes == 3 << 20
    finally:
        store.close()
    with pytest.raises(flashmem.FlashMemError, match="cold_pending_mb"):
        flashmem.FlashMemoryConfig(cold_pending_mb=0)
