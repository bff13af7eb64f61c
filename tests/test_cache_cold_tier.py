"""The cache over every cold tier (memory / disk / layered, any codec), with and without prefetch.

Exactness anchor as in test_cache.py: with every sealed block selected
(lsa_keep_ratio=1.0) and an exact codec, the logits must equal DynamicCache's
whichever tier the blocks come back from; prefetch must not change a bit.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import flashmem
from flashmem import policies
from flashmem.cache.flash_layer import FlashLayer
from flashmem.cache.lookahead import neighbour_radius, predict_next_blocks
from flashmem.store.memory import MemoryStore
from test_cache import ALL_EXACT, SMALL, reference, run
from tiny_models import tiny_llama

torch.set_num_threads(1)

PROMPT = 200
STEPS = 24


def cfg(tmp_path, **kw) -> flashmem.FlashMemoryConfig:
    base = dict(ALL_EXACT, cold_store="disk", cold_dir=str(tmp_path), prefetch_threads=2, prefetch_window=1024)
    merged = {**base, **kw}
    if merged["cold_store"] == "memory":  # a folder with a memory store is refused (no files to put there)
        merged.pop("cold_dir")
    return flashmem.FlashMemoryConfig(**merged)


def folders(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path)) if os.path.isdir(tmp_path) else []


@pytest.fixture(scope="module")
def model_and_ref():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref = reference(model, ids, STEPS)
    return model, ids, ref


# ------------------------------------------------------------------ look-ahead (pure)
def test_predict_next_blocks_neighbours_window_and_cap():
    idx = torch.tensor([[[0, 5]], [[9, 5]]])  # [b=2, h=1, k=2]
    assert predict_next_blocks(idx, 10, 128, 1024) == [0, 5, 9, 1, 4, 6, 8]  # selected first
    assert predict_next_blocks(idx, 10, 128, 127) == [0, 5, 9]  # neighbours beyond the window
    assert predict_next_blocks(idx, 10, 128, 0) == [0, 5, 9]
    assert sorted(predict_next_blocks(idx, 10, 128, 1024, radius=2)) == list(range(10))
    assert predict_next_blocks(idx, 10, 128, 1024, radius=2)[7:] == [2, 3, 7]  # distance 2 last
    assert predict_next_blocks(idx, 10, 128, 1024, max_blocks=4) == [0, 5, 9, 1]
    assert predict_next_blocks(idx, 10, 128, 1024, max_blocks=0) == []
    assert predict_next_blocks([3, 3], 4, 16, 16) == [3, 2]  # clipped to sealed blocks
    assert predict_next_blocks([], 4, 16, 16) == [] and predict_next_blocks([1], 0, 16, 16) == []
    assert neighbour_radius(128, 300, radius=4) == 2


# ------------------------------------------------------------------ exactness per tier
@pytest.mark.parametrize("kind", sorted(policies.COLD_STORES))
@pytest.mark.parametrize("threads", [0, 2])
def test_exact_codec_equals_dynamic_cache(model_and_ref, tmp_path, kind, threads):
    model, ids, ref = model_and_ref
    extra = {"cold_ram_bytes": 64 * 1024} if kind == "layered" else {}  # small: disk reads too
    with flashmem.attach(model, cfg(tmp_path, cold_store=kind, prefetch_threads=threads, **extra)) as cache:
        out = run(model, cache, ids, STEPS)
        st = cache.stats()
        assert cache.memory_report()["cold_bytes"] > 0
    assert (out - ref).abs().max() <= 1e-4
    # a memory store on the CPU is read directly: loader threads would only add overhead
    assert st["prefetch"] is (threads > 0 and kind != "memory")
    assert st["hits"] + st["misses"] > 0 and st["bytes_written"] > 0
    # reads come from the files, or from memory while the background write is pending (timing)
    pending = sum(t.get("pending_hits", 0) for t in st["tiers"].values())
    assert st["bytes_read"] > 0 or pending > 0 or kind == "memory"
    if kind == "lmdb":
        assert set(st["tiers"]) == {"prefetch", "lmdb"} and st["tiers"]["lmdb"]["bytes_written"] > 0
    if kind == "layered":
        assert set(st["tiers"]) == {"prefetch", "ram", "disk"}
        assert st["tiers"]["disk"]["bytes_written"] > 0
    for tier in st["tiers"].values():
        assert {"hits", "misses", "stall_s", "bytes_read", "bytes_written"} <= set(tier)
    assert folders(tmp_path) == []


# measured max |error|: int8 ~3e-4, int4 ~6e-3 (logits ~0.5)
@pytest.mark.parametrize("codec,tol", [("int8", 5e-3), ("int4", 5e-2)])
@pytest.mark.parametrize("kind", ["disk", "layered", "lmdb"])
def test_lossy_codecs_stay_close(model_and_ref, tmp_path, codec, tol, kind):
    model, ids, ref = model_and_ref
    with flashmem.attach(model, cfg(tmp_path, cold_store=kind, cold_codec=codec)) as cache:
        out = run(model, cache, ids, STEPS)
    err = (out - ref).abs().max().item()
    assert torch.isfinite(out).all() and 0 < err <= tol, err


def test_prefetch_on_off_identical_and_hits_during_decode(model_and_ref, tmp_path):
    model, ids, _ = model_and_ref
    # ratio < 1 so selections move between steps and look-ahead has work to do
    c = dict(SMALL, lsa_keep_ratio=0.3)
    outs, stats = [], []
    for threads in (0, 2):
        with flashmem.attach(model, cfg(tmp_path, **c, prefetch_threads=threads)) as cache:
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True)
            before = cache.stats()
            outs.append(run_decode(model, cache, 40))
            after = cache.stats()
        stats.append((before, after))
    assert torch.equal(outs[0], outs[1])
    (_, off), (before, on) = stats
    assert off["hits"] == 0 and off["misses"] > 0 and off["stall_s"] > 0
    assert on["hits"] - before["hits"] > 0  # look-ahead loaded blocks before decode asked for them
    assert on["tiers"]["prefetch"]["requested"] > 0
    assert on["tiers"]["disk"]["bytes_read"] > 0 or on["tiers"]["disk"].get("pending_hits", 0) > 0


def test_blocks_kept_after_use_save_reads_and_change_nothing(model_and_ref, tmp_path):
    """The prefetcher keeps a block after handing it out (`keep_used`): selections that
    come back to a block, and look-ahead asking for the blocks just used, read less from
    disk; the outputs are the same."""
    model, ids, _ = model_and_ref
    c = dict(SMALL, lsa_keep_ratio=0.3)
    outs, reads = [], []
    for keep in (False, True):
        with flashmem.attach(model, cfg(tmp_path, **c)) as cache:
            cache.prefetcher.keep_used = keep
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True)
            before = cache.stats()["tiers"]["disk"]["gets"]
            outs.append(run_decode(model, cache, 30))
            reads.append(cache.stats()["tiers"]["disk"]["gets"] - before)
    assert torch.equal(outs[0], outs[1])
    assert reads[1] < reads[0]


def run_decode(model, cache, steps):
    outs = []
    tok = torch.full((1, 1), 5)
    with torch.no_grad():
        for _ in range(steps):
            outs.append(model(tok, cache=cache, use_cache=True).logits[:, -1])
            tok = (tok * 7 + 3) % 128
    return torch.stack(outs, 1)


# ------------------------------------------------------------------ lifecycle
def test_folder_removed_on_close_and_gc_kept_with_persist(model_and_ref, tmp_path):
    model, ids, _ = model_and_ref
    cache = flashmem.attach(model, cfg(tmp_path))
    run(model, cache, ids, 2)
    assert len(folders(tmp_path)) == 1
    cache.close()
    assert folders(tmp_path) == [] and cache.closed
    cache.close()  # idempotent

    cache = flashmem.attach(model, cfg(tmp_path, cold_store="layered"))
    run(model, cache, ids, 2)
    assert len(folders(tmp_path)) == 1
    pf = cache.prefetcher
    del cache
    gc.collect()
    assert folders(tmp_path) == []
    assert pf._closed  # the prefetcher was closed too

    persist = tmp_path / "persist"
    with flashmem.attach(model, cfg(persist, persist=True)) as cache:
        run(model, cache, ids, 2)
        puts = cache.stats()["puts"]
    kept = folders(persist)
    assert len(kept) == 1
    from flashmem.store import DiskStore

    with DiskStore.reopen(str(persist / kept[0]), persist=False) as s:
        assert len(s) == puts > 0
    assert folders(persist) == []


def test_two_caches_one_cold_dir_in_two_threads(model_and_ref, tmp_path):
    model, ids, ref = model_and_ref
    alone = {}
    for layered in (False, True):
        with flashmem.attach(model, cfg(tmp_path, cold_store="layered" if layered else "disk")) as c:
            alone[layered] = run(model, c, ids, STEPS)
    caches = {k: flashmem.attach(model, cfg(tmp_path, cold_store="layered" if k else "disk")) for k in alone}
    results, errors = {}, []

    def work(k):
        try:
            results[k] = run(model, caches[k], ids, STEPS)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(folders(tmp_path)) == 2
    for k, c in caches.items():
        assert torch.equal(results[k], alone[k])
        assert (results[k] - ref).abs().max() <= 1e-4
        c.close()
    assert folders(tmp_path) == []


# ------------------------------------------------------------------ store contract, collaborators
def test_store_contract_coded_reads_and_codec(tmp_path):
    from flashmem.store import MemoryStore, open_store

    k = torch.randn(1, 2, 8, 16)
    with MemoryStore() as mem:
        mem.put((0, 0), k, k)
        assert not mem.coded_reads and mem.codec.name == "exact"
        with pytest.raises(NotImplementedError, match="no coded reads"):
            mem.get_coded((0, 0))
    for kind in ("disk", "layered"):
        with open_store(cfg(tmp_path, cold_store=kind, cold_codec="int8"), dtype=torch.float32) as s:
            s.put((0, 0), k, k)
            payload, shape, dtype, _ = s.get_coded((0, 0))
            assert s.coded_reads and shape == (1, 2, 8, 16) and dtype == torch.float32
            assert payload.numel() == s.codec.nbytes(shape, dtype)


def test_prefetcher_is_given_to_the_layers_and_can_be_bypassed(model_and_ref, tmp_path):
    model, ids, ref = model_and_ref
    with flashmem.attach(model, cfg(tmp_path)) as cache:
        layers = cache.flash_layers
        assert all(layer.prefetcher is cache.prefetcher for layer in layers)
        share = int(0.9 * cache.prefetcher.ready_bytes) // len(layers)
        assert all(layer.lookahead_bytes == share for layer in layers)
        cache.use_prefetcher(False)
        out = run(model, cache, ids, 4)
        assert cache.stats()["hits"] == 0  # nothing went through the prefetcher
        assert cache.sync_reads()["misses"] > 0
    assert (out - ref[:, : out.shape[1]]).abs().max() <= 1e-4


# ------------------------------------------------------------------ page gather
def test_memory_store_gathers_pages_as_cut_from_whole_blocks():
    """MemoryStore.gather_pages equals cutting each page out of `get`'s block, across
    the arena's growth (block ids past 64 slots) and with rows/heads choosing apart."""
    store = MemoryStore()
    g = torch.Generator().manual_seed(0)
    b, h, B, d, ppb = 2, 3, 16, 8, 4
    for j in range(150):
        store.put((1, j), torch.randn(b, h, B, d, generator=g), torch.randn(b, h, B, d, generator=g))
    blocks = torch.randint(0, 150, (b, h, 7), generator=g)
    within = torch.randint(0, ppb, (b, h, 7), generator=g)
    got_k, got_v = store.gather_pages(1, blocks, within, ppb, torch.device("cpu"))
    P = B // ppb
    for r in range(b):
        for hh in range(h):
            for i in range(7):
                k, v = store.get((1, int(blocks[r, hh, i])))
                w = int(within[r, hh, i])
                assert torch.equal(got_k[r, hh, i], k[r, hh, w * P : (w + 1) * P])
                assert torch.equal(got_v[r, hh, i], v[r, hh, w * P : (w + 1) * P])
    # Overwriting a block is seen by the next gather.
    store.put((1, 3), torch.zeros(b, h, B, d), torch.ones(b, h, B, d))
    k3, v3 = store.gather_pages(1, torch.full((b, h, 1), 3), torch.zeros(b, h, 1, dtype=torch.long), ppb, "cpu")
    assert not k3.any() and bool((v3 == 1).all())
    # What it cannot serve, it declines (the caller reads whole blocks instead).
    assert store.gather_pages(2, blocks, within, ppb, "cpu") is None  # no such layer
    assert store.gather_pages(1, torch.full((b, h, 1), 400), within[..., :1], ppb, "cpu") is None
    store.put((1, 5), torch.zeros(b, h, 2 * B, d), torch.zeros(b, h, 2 * B, d))  # another shape: kept apart
    assert store.get((1, 5))[0].shape[-2] == 2 * B
    assert store.gather_pages(1, torch.full((b, h, 1), 5), within[..., :1], ppb, "cpu") is None
    coded = MemoryStore(codec="int8")
    coded.put((0, 0), torch.randn(b, h, B, d), torch.randn(b, h, B, d))
    assert coded.gather_pages(0, torch.zeros(b, h, 1, dtype=torch.long), within[..., :1], ppb, "cpu") is None


def test_direct_page_gather_equals_reads_through_the_prefetcher(model_and_ref):
    """A partial selection read from the memory store's arena gives the same logits as
    whole blocks read through the prefetcher and cut (FlashLayer.read_memory_directly)."""
    model, ids, _ = model_and_ref
    c = flashmem.FlashMemoryConfig(**dict(SMALL, lsa_keep_ratio=0.3, lsa_page_tokens=4, prefetch_threads=2))
    outs = []
    for direct in (True, False):
        FlashLayer.read_memory_directly = direct
        try:
            with flashmem.attach(model, c) as cache:
                with torch.no_grad():
                    model(ids, cache=cache, use_cache=True)
                outs.append(run_decode(model, cache, 30))
                assert (cache.flash_layers[0].prefetcher is None) == direct
                assert cache.stats()["misses"] > 0
        finally:
            FlashLayer.read_memory_directly = True
    assert torch.equal(outs[0], outs[1])


def test_shared_heads_read_fewer_blocks_and_stay_exact_when_all_fit(model_and_ref, tmp_path):
    """lsa_share_heads: every KV head attends the same pages, so a step reads fewer
    cold blocks than per-head selection; with every block selected it is still exact."""
    model, ids, ref = model_and_ref
    with flashmem.attach(model, cfg(tmp_path, lsa_share_heads=True)) as cache:
        out = run(model, cache, ids, 4)
    assert (out - ref[:, : out.shape[1]]).abs().max() <= 1e-4
    misses = {}
    for share in (False, True):
        c = flashmem.FlashMemoryConfig(**dict(SMALL, lsa_keep_ratio=0.2, lsa_share_heads=share))
        with flashmem.attach(model, c) as cache:
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True)
            before = cache.stats()["misses"]
            run_decode(model, cache, 20)
            misses[share] = cache.stats()["misses"] - before
            sel = [layer.ws_idx for layer in cache.flash_layers]
            assert all(bool((s == s[:, :1]).all()) for s in sel) == share
    assert misses[True] < misses[False]
