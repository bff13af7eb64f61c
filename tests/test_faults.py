"""Fault and abuse suite (issue 11): each test names the failure class it keeps fixed.

Cache lifecycle on tiny models: reset with prefetch, write errors mid-seal,
use after close, batch-size changes, config keys that would do nothing.
Disk-level faults and the CLI live in tests/faults/.
"""

from __future__ import annotations

import errno
import time

import pytest
import torch

import flashmem
from flashmem import policies
from flashmem.cache.flash_layer import FlashLayer
from flashmem.errors import ColdStoreError, ConfigError, FlashMemError
from test_cache import SMALL
from tiny_models import tiny_llama

torch.set_num_threads(1)

STORES = sorted(policies.COLD_STORES)  # every registered cold store


def cfg(tmp_path, **kw) -> flashmem.FlashMemoryConfig:
    base = dict(SMALL, lsa_top_k=2, cold_store="memory", prefetch_threads=2, prefetch_window=1024)
    if kw.get("cold_store", "memory") != "memory":
        base["cold_dir"] = str(tmp_path)
    return flashmem.FlashMemoryConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def ids(seed: int, n: int = 160) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def generate(model, cache, prompt: torch.Tensor, steps: int = 12) -> torch.Tensor:
    """Greedy decode; logits [steps+1, vocab]."""
    outs = []
    with torch.no_grad():
        out = model(prompt, cache=cache, use_cache=True)
        for _ in range(steps):
            outs.append(out.logits[0, -1])
            tok = out.logits[:, -1:].argmax(-1)
            out = model(tok, cache=cache, use_cache=True)
        outs.append(out.logits[0, -1])
    return torch.stack(outs)


def settle(cache) -> None:
    """Let background prefetch loads finish, so the ready buffer holds what look-ahead asked for."""
    pf = cache.prefetcher
    deadline = time.monotonic() + 10
    while pf is not None and pf.stats()["inflight"] and time.monotonic() < deadline:
        time.sleep(0.01)


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ 1. reset with prefetch
@pytest.mark.parametrize("kind", STORES)
def test_reset_with_prefetch_equals_fresh_cache(model, tmp_path, kind, monkeypatch):
    """Issue 11 item 1: after reset(), no block of the previous prompt is served to the next."""
    # a memory store is read through the prefetcher on accelerators only: force it here
    monkeypatch.setattr(FlashLayer, "read_memory_directly", False)
    c = cfg(tmp_path, cold_store=kind)
    with flashmem.attach(model, c) as fresh:
        want = generate(model, fresh, ids(2))
    with flashmem.attach(model, c) as cache:
        generate(model, cache, ids(1))
        settle(cache)
        assert cache.prefetcher.stats()["ready_blocks"] > 0  # stale candidates are waiting
        cache.reset()
        got = generate(model, cache, ids(2))
    assert torch.equal(got, want), (got - want).abs().max()


# ------------------------------------------------------------------ 8. write error mid-seal
def test_write_error_is_one_line_then_refused_then_reset_works(model, tmp_path, monkeypatch):
    """Issue 11 item 8: a background ENOSPC surfaces as one ColdStoreError; the next
    call is a one-line refusal (never a tensor-size RuntimeError); reset() starts over."""
    import flashmem.store.disk_core as dc

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    c = cfg(tmp_path, cold_store="disk", prefetch_threads=0)
    with flashmem.attach(model, c) as fresh:
        want = generate(model, fresh, ids(2), steps=4)
    with flashmem.attach(model, c) as cache:
        monkeypatch.setattr(dc, "pwrite_all", full)
        with pytest.raises(ColdStoreError) as err:
            for _ in range(20):  # the error is raised by the first put after the failed write
                with torch.no_grad():
                    model(ids(1, 40), cache=cache, use_cache=True)
                time.sleep(0.05)
        assert "ENOSPC" in one_line(err.value)
        with pytest.raises(FlashMemError) as again:
            with torch.no_grad():
                model(ids(1, 1), cache=cache, use_cache=True)
        assert "reset()" in one_line(again.value)
        cache.reset()  # blocks of the new prompt stay in memory: the output is exact
        got = generate(model, cache, ids(2), steps=4)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", STORES)
def test_seal_is_all_or_nothing_when_put_fails(model, tmp_path, kind):
    """Issue 11 item 8: a put that raises leaves every tier of the layer consistent."""
    with flashmem.attach(model, cfg(tmp_path, cold_store=kind, prefetch_threads=0)) as cache:
        layer = cache.flash_layers[0]
        real = layer.store.put
        calls = []

        def flaky(key, k, v):
            real(key, k, v)  # the block is kept, as DiskStore does before it reports
            calls.append(key)
            if len(calls) == 2:
                raise ColdStoreError("cold store x: background write failed: No space left on device (ENOSPC)")

        layer.store = type(
            "S", (), {"put": staticmethod(flaky), "__getattr__": lambda s, n: getattr(real.__self__, n)}
        )()
        with pytest.raises(ColdStoreError):
            with torch.no_grad():
                model(ids(1, 120), cache=cache, use_cache=True)
        n = layer.num_sealed
        pages = layer.cfg.hca_chunk_size // layer.cfg.page_tokens
        assert n > 0 and layer.index.count == n * pages and layer.summaries.hca_cnt.shape[-1] == n
        assert layer.block_start + n * 16 + layer.open_k.shape[-2] + layer.win_k.shape[-2] == layer.valid.shape[-1]


# ------------------------------------------------------------------ 9. use after close
@pytest.mark.parametrize("kind", STORES)
def test_any_use_after_close_is_one_line_cold_store_error(model, tmp_path, kind):
    """Issue 11 item 9: close() really closes, whatever the store."""
    cache = flashmem.attach(model, cfg(tmp_path, cold_store=kind))
    generate(model, cache, ids(1), steps=2)
    cache.close()
    with pytest.raises(ColdStoreError) as err:
        with torch.no_grad():
            model(ids(2, 3), cache=cache, use_cache=True)
    assert "closed" in one_line(err.value)
    with pytest.raises(ColdStoreError):
        cache.store.get((0, 0))
    with pytest.raises(ColdStoreError):
        cache.store.put((0, 0), torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16))


def test_memory_store_close_refuses_put_get():
    """Issue 11 item 9 at the store level."""
    from flashmem.store import MemoryStore

    s = MemoryStore()
    k = torch.ones(1, 1, 4, 2)
    s.put((0, 0), k, k)
    s.close()
    for use in (lambda: s.get((0, 0)), lambda: s.put((0, 1), k, k)):
        with pytest.raises(ColdStoreError, match="after close"):
            use()
    assert (0, 0) not in s


# ------------------------------------------------------------------ 10. batch size changes
def test_batch_size_change_mid_sequence_is_one_line(model, tmp_path):
    """Issue 11 item 10: prefill with 1 row, decode with 2 -> FlashMemError naming both sizes."""
    with flashmem.attach(model, cfg(tmp_path)) as cache:
        with torch.no_grad():
            model(ids(1), cache=cache, use_cache=True)
            with pytest.raises(FlashMemError) as err:
                model(torch.zeros(2, 1, dtype=torch.long), cache=cache, use_cache=True)
        msg = one_line(err.value)
        assert "batch size" in msg and "1" in msg and "2" in msg and "reset()" in msg
        cache.reset()  # a new sequence may use another batch size
        with torch.no_grad():
            out = model(ids(3, 40).repeat(2, 1), cache=cache, use_cache=True)
        assert torch.allclose(out.logits[0], out.logits[1])


# ------------------------------------------------------------------ 11. keys that do nothing
def test_persist_with_memory_store_is_rejected():
    """Issue 11 item 11: persist only means something for a store with files."""
    with pytest.raises(ConfigError) as err:
        flashmem.FlashMemoryConfig(persist=True, cold_store="memory")
    msg = one_line(err.value)
    assert "persist" in msg and "disk" in msg
    flashmem.FlashMemoryConfig(persist=True, cold_store="disk", cold_dir="/tmp")  # still fine
