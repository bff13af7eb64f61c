"""The C heap's free pages handed back after a prompt with a cold tier off RAM (cache/host_heap.py)."""

from __future__ import annotations

import ctypes.util
import sys
from pathlib import Path

import pytest
import torch

import flashmem
from flashmem.cache import flash_cache, host_heap
from flashmem.cache.scratch import thread_scratch
from tiny_models import tiny_llama

GLIBC = sys.platform.startswith("linux") and host_heap._malloc_trim() is not None


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim on Linux")
def test_free_heap_pages_go_back_to_the_os():
    # 64 KiB tensors come from the heap (under glibc's mmap threshold); freeing every other
    # one leaves holes that free() cannot return by trimming the heap's top
    held = [torch.ones(16 * 1024) for _ in range(3000)]
    del held[::2]
    before = _rss_kib()
    assert host_heap.release_free_memory() is True  # glibc says it released memory
    after = _rss_kib()
    assert before - after > 40 * 1024, (before, after)  # about 94 MiB of holes
    assert all(float(t[0]) == 1.0 for t in held)  # live memory untouched


def test_without_glibc_nothing_happens(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    host_heap._malloc_trim.cache_clear()
    try:
        assert host_heap.release_free_memory() is False
    finally:
        host_heap._malloc_trim.cache_clear()


def _cache(store: str, tmp_path: Path):
    model = tiny_llama(layers=1)
    keys = dict(cold_store="disk", cold_dir=str(tmp_path)) if store == "disk" else {}
    cfg = flashmem.FlashMemoryConfig(gpu_cache_limit=16, sink_tokens=2, hca_chunk_size=16, prefill_chunk=32, **keys)
    return model, flashmem.attach(model, cfg)


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_prefill_drops_the_prompts_buffers_and_hands_the_heap_back_with_a_disk_tier(store, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(flash_cache, "release_free_memory", lambda: calls.append(1) or True)
    model, cache = _cache(store, tmp_path)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    last = flashmem.prefill(model, cache, ids, chunk=64)
    assert thread_scratch().nbytes() == 0  # sized for a chunk's rows: dropped
    assert len(calls) == (1 if store == "disk" else 0)  # once, after the prompt's last forward
    with torch.no_grad():
        model(last[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert 0 < thread_scratch().nbytes()  # a decode step's, regrown
    assert len(calls) == (1 if store == "disk" else 0)  # prefill said so already: not again
    cache.close()


def test_under_generate_the_first_one_token_forward_ends_the_prompt(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(flash_cache, "release_free_memory", lambda: calls.append(1) or True)
    model, cache = _cache("disk", tmp_path)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)  # the prompt in one forward, as generate() feeds it
        assert calls == [] and thread_scratch().nbytes() > 0
        model(ids[:, :1], cache=cache, use_cache=True)
        assert calls == [1]
        model(ids[:, :1], cache=cache, use_cache=True)
        model(ids[:, :3], cache=cache, use_cache=True)  # a verify forward (assisted decoding)
        model(ids[:, :1], cache=cache, use_cache=True)
    assert calls == [1]  # the prompt ends once: the buffers a verify forward grew are kept
    cache.close()


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_prefill_feeds_a_disk_tiers_prompt_in_forwards_of_its_prefill_chunk(store, tmp_path):
    """Off RAM a forward's activations are most of the prompt's peak RSS: the default forward is
    the cache's prefill_chunk there, DEFAULT_CHUNK (here: the whole prompt) elsewhere."""
    model, cache = _cache(store, tmp_path)
    sizes: list[int] = []

    def record(mod, args, kw):
        sizes.append((args[0] if args else kw["input_ids"]).shape[1])

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        flashmem.prefill(model, cache, torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0)))
    finally:
        hook.remove()
        cache.close()
    assert sizes == ([32, 32, 32, 4] if store == "disk" else [100])
