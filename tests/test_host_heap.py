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


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt on Linux")
def test_a_fixed_mmap_threshold_hands_freed_blocks_back_at_once():
    """Process-wide, so in a child process: after a 16 MiB block is freed glibc's own threshold
    rises past 1 MiB blocks, which then come from the heap and stay there when freed between
    live ones; fixed at 64 KiB they are mapped and go back to the OS as they are freed."""
    import subprocess

    child = """
import sys, torch
from pathlib import Path
from flashmem.cache import host_heap
def rss():
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
if sys.argv[1] == "fixed":
    assert host_heap.set_mmap_threshold(65536)
big = torch.ones(4 << 20)  # a 16 MiB block, mapped and freed: glibc's threshold rises to it
del big
held = [torch.ones(1 << 18) for _ in range(128)]  # 1 MiB blocks, every other one freed below:
before = rss()  # holes between live blocks, which no trim of the heap's top can hand back
del held[::2]
print(before - rss())
"""
    freed = {
        how: int(subprocess.run([sys.executable, "-c", child, how], capture_output=True, text=True, check=True).stdout)
        for how in ("glibc", "fixed")
    }
    assert freed["fixed"] > 48 * 1024, freed  # KiB: most of the 64 MiB back at once
    assert freed["glibc"] < 16 * 1024, freed  # glibc's own threshold kept them in the heap


def test_the_cache_fixes_the_threshold_it_is_given_and_refuses_a_bad_one(monkeypatch):
    calls = []
    monkeypatch.setattr(flash_cache, "set_mmap_threshold", lambda n: calls.append(n) or True)
    model = tiny_llama(layers=1)
    flashmem.attach(model, flashmem.FlashMemoryConfig(gpu_cache_limit=16, hca_chunk_size=16)).close()
    assert calls == []  # left as glibc has it unless asked
    cfg = flashmem.FlashMemoryConfig(gpu_cache_limit=16, hca_chunk_size=16, host_mmap_threshold=65536)
    flashmem.attach(model, cfg).close()
    assert calls == [65536]
    monkeypatch.setattr(flash_cache, "set_mmap_threshold", lambda n: False)  # not glibc
    with pytest.warns(UserWarning, match="host_mmap_threshold needs glibc"):
        flashmem.attach(model, cfg).close()
    for bad in (100, 64 << 20):
        with pytest.raises(ValueError, match="host_mmap_threshold"):
            flashmem.FlashMemoryConfig(host_mmap_threshold=bad)
