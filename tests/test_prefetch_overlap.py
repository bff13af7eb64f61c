"""Prefetch overlaps the cold tier's reads with compute, and the stall accounting says so.

A ThrottledStore charges every read bytes / rate seconds (tens of ms here, well
above scheduling noise), so the stall a step sees is known in advance:
- a synchronous read of N bytes at R bytes/s stalls at least N / R;
- a block prefetched during a step's "compute" (a fixed sleep, longer than the
  read) is a hit and costs the step ~0;
- in the same test, the stall with prefetch is below the stall without it.
The device-side half (pinned host blocks, the copy issued on a copy stream, the
compute stream waiting on its event) runs with a recording copier on the CPU, and
for real where CUDA is present (docs/accelerator.md, "Prefetch").
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import flashmem
from flashmem.cache import flash_cache
from flashmem.errors import ConfigError
from flashmem.store import DiskStore, MemoryStore, Prefetcher
from flashmem.store.throttled import ThrottledStore
from flashmem.store.transfer import CopyStream
from test_cache import SMALL
from tiny_models import tiny_llama

torch.set_num_threads(1)

SHAPE = (1, 2, 64, 32)  # [b, h, B, d] fp32: K + V = 32 KiB a block
BLOCK_BYTES = 2 * 64 * 64 * 4
READ_S = 0.05  # one block's read through the throttle
RATE = BLOCK_BYTES / READ_S  # bytes per second


def block(idx: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer * 100003 + idx)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def throttled(n: int = 8, codec: str = "exact", rate: float = RATE) -> ThrottledStore:
    store = ThrottledStore(MemoryStore(codec=codec), rate)
    for i in range(n):
        store.put((0, i), *block(i))
    return store


def timed_get(pf: Prefetcher, key, device="cpu"):
    t0 = time.perf_counter()
    out = pf.get(key, device)
    return out, time.perf_counter() - t0


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.time() + timeout
    while not cond():
        assert time.time() < end
        time.sleep(0.002)


# ------------------------------------------------------------------ the throttle
def test_throttle_charges_each_read_its_bytes_over_the_rate(tmp_path):
    store = throttled(2)
    t0 = time.perf_counter()
    k, v = store.get((0, 1))
    took = time.perf_counter() - t0
    assert torch.equal(k, block(1)[0]) and torch.equal(v, block(1)[1])
    assert took >= READ_S and store.charged_bytes == BLOCK_BYTES and store.reads == 1
    assert store.charged_s == pytest.approx(READ_S)
    # serial: two readers at once share one link, so together they take two reads' time
    t0 = time.perf_counter()
    readers = [threading.Thread(target=store.get, args=((0, i),)) for i in range(2)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert time.perf_counter() - t0 >= 2 * READ_S and store.reads == 3
    # a store that hands out coded payloads is charged the payload, not the decoded K/V
    with ThrottledStore(DiskStore(str(tmp_path), codec="int8"), RATE) as coded:
        coded.put((0, 0), *block(0))
        coded.flush()
        payload, shape, _, _ = coded.get_coded((0, 0))
        assert coded.coded_reads and tuple(shape) == SHAPE
        assert coded.charged_bytes == payload.nbytes < BLOCK_BYTES / 2 and coded.reads == 1
    # whole blocks only: the arena paths are declined, so every byte read is charged
    assert store.block_run(0, 0, 2) is None and store.block_keys(0, 2, "cpu") is None
    assert store.gather_pages(0, None, None, 4, "cpu") is None
    assert (0, 1) in store and (0, 9) not in store and store.nbytes() == store.inner.nbytes()


@pytest.mark.parametrize("rate", [0, -1.0, float("inf"), float("nan"), "fast"])
def test_throttle_refuses_a_rate_that_is_not_a_positive_number(rate):
    with pytest.raises(ConfigError, match="bytes_per_s.*allowed: a finite number > 0"):
        ThrottledStore(MemoryStore(), rate)


# ------------------------------------------------------------------ overlap, counted
def run_steps(pf: Prefetcher, steps: int, compute_s: float, ahead: bool) -> list[float]:
    """A decode loop: each step needs block i, asks for block i+1 ahead (when `ahead`),
    then computes for compute_s. Returns each get's wall time."""
    waits = []
    for i in range(steps):
        (k, _), took = timed_get(pf, (0, i))
        assert torch.equal(k, block(i)[0])
        waits.append(took)
        if ahead:
            pf.request([(0, i + 1)])
        time.sleep(compute_s)  # the step's compute: the loader reads the next block meanwhile
    return waits


def test_prefetch_hides_the_read_behind_compute_and_stall_accounts_for_it():
    steps, compute_s = 5, 2 * READ_S
    with Prefetcher(throttled(steps + 1), threads=0) as sync:
        waits_off = run_steps(sync, steps, compute_s, ahead=False)
        off = sync.stats()
    with Prefetcher(throttled(steps + 1), threads=2) as pf:
        waits_on = run_steps(pf, steps, compute_s, ahead=True)
        on = pf.stats()
    # without prefetch: every get is a synchronous read of BLOCK_BYTES at RATE
    assert off["misses"] == steps and off["hits"] == 0
    assert all(w >= READ_S for w in waits_off)
    assert off["stall_s"] >= steps * READ_S
    # with it: the first block is read on demand, the rest were loaded during compute
    assert on["misses"] == 1 and on["late"] == 0 and on["hits"] == steps - 1
    assert READ_S <= on["stall_s"] < 2 * READ_S  # only the first read stalled
    assert waits_on[0] >= READ_S
    assert max(waits_on[1:]) < READ_S / 2, waits_on  # a prefetched block costs the step ~0
    assert on["stall_s"] < off["stall_s"] / 2
    assert on["load_s"] >= steps * READ_S  # the same reads happened, behind compute


def test_a_block_asked_for_while_in_flight_stalls_for_the_rest_of_its_read():
    with Prefetcher(throttled(2), threads=1) as pf:
        pf.request([(0, 1)])
        time.sleep(READ_S / 2)  # half the read is hidden
        _, took = timed_get(pf, (0, 1))
        st = pf.stats()
    assert st["late"] == 1 and st["misses"] == 1 and st["hits"] == 0
    assert st["stall_s"] == pytest.approx(took, abs=0.01)
    assert st["stall_s"] < READ_S  # less than a synchronous read


# ------------------------------------------------------------------ the device side
class RecordingCopier:
    """Stands in for a CUDA CopyStream on the CPU: records what is issued where, and waits."""

    stages = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.issued: list[tuple[str, int]] = []  # (thread name, first element's data_ptr)
        self.waited: list[object] = []

    def issue(self, tensors):
        moved = tuple(t.clone() for t in tensors)  # "on the device": a copy, not the host block
        done = object()
        self.issued.append((threading.current_thread().name, tensors[0].data_ptr()))
        return moved, done

    def wait(self, moved, done):
        self.waited.append(done)
        return moved


@pytest.fixture
def recording(monkeypatch):
    copier = RecordingCopier()
    monkeypatch.setattr(Prefetcher, "_copier", lambda self, device: copier)

    def no_sync(*a, **k):
        raise AssertionError("torch.cuda.synchronize called: get must wait on the copy's event")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    return copier


def test_the_copy_is_issued_when_the_block_lands_and_get_waits_on_its_event(recording):
    fast = 1e12  # no throttle: this is about order, not time
    with Prefetcher(throttled(6, rate=fast), threads=1, stage_bytes=2 * BLOCK_BYTES) as pf:
        pf.request([(0, 0), (0, 1), (0, 2)], device="cpu")
        wait_for(lambda: pf.stats()["ready_blocks"] == 3 and pf.stats()["inflight"] == 0)
        st = pf.stats()
        # issued by the loader thread as each block landed, before anything asked for it;
        # two fit in stage_bytes, so the oldest unused copy (block 0) made room for block 2
        assert st["staged"] == 3 and st["stage_dropped"] == 1
        assert st["staged_blocks"] == 2 and st["staged_bytes"] == 2 * BLOCK_BYTES
        assert all(name.startswith("flashmem-prefetch") for name, _ in recording.issued)
        assert sorted(key[1] for key in pf._staged) == [1, 2]
        for i in range(3):
            k, v = pf.get((0, i), "cpu")
            assert torch.equal(k, block(i)[0]) and torch.equal(v, block(i)[1])
        st = pf.stats()
        # block 0 was copied when asked; 1 and 2 came from their staged copies, after a wait
        assert st["hits"] == 3 and st["staged_hits"] == 2 and len(recording.waited) == 2
        assert st["staged_blocks"] == 0 and st["staged_bytes"] == 0  # handed out, not kept
        # a block kept after use (keep_used) and asked for again is not copied ahead again
        n = len(recording.issued)
        assert pf.request([(0, 1)]) == 0 and len(recording.issued) == n
        # leaving the ready buffer, or a new sequence, drops a block's device copy
        pf.request([(0, 3), (0, 4)])
        wait_for(lambda: pf.stats()["staged_blocks"] == 2)
        pf.discard([(0, 3)])
        assert pf.stats()["staged_blocks"] == 1 and pf.stats()["staged_bytes"] == BLOCK_BYTES
        pf.new_sequence(0)
        assert pf.stats()["staged_blocks"] == 0 and pf.stats()["staged_bytes"] == 0


def test_a_staged_block_asked_for_on_another_device_is_copied_again(recording):
    with Prefetcher(throttled(2, rate=1e12), threads=1) as pf:
        pf.request([(0, 0)], device="cpu")
        wait_for(lambda: pf.stats()["staged_blocks"] == 1)
        k, _ = pf.get((0, 0), "meta")  # not the device it was staged on
        assert k.device.type == "meta" and recording.waited == [] and pf.stats()["staged_hits"] == 0


def test_a_copy_that_cannot_be_issued_leaves_the_block_host_side(recording, monkeypatch):
    def out_of_memory(tensors):
        raise torch.cuda.OutOfMemoryError("device full")

    monkeypatch.setattr(recording, "issue", out_of_memory)
    with Prefetcher(throttled(2, rate=1e12), threads=1) as pf:
        pf.request([(0, 0)], device="cpu")
        wait_for(lambda: pf.stats()["stage_errors"] == 1)
        k, _ = pf.get((0, 0), "cpu")
        st = pf.stats()
    assert torch.equal(k, block(0)[0]) and st["hits"] == 1 and st["staged_hits"] == 0
    assert st["staged_bytes"] == 0 and recording.waited == []


def test_every_loaded_block_goes_through_the_host_staging(monkeypatch):
    """Loads are held as `ensure_host` gives them back (pinned memory when CUDA is present)."""
    from flashmem.store import prefetch

    made: list[torch.Tensor] = []

    def host(t):
        made.append(t.clone())
        return made[-1]

    monkeypatch.setattr(prefetch, "ensure_host", host)
    with Prefetcher(throttled(3, rate=1e12), threads=1) as pf:
        pf.request([(0, 0)])
        wait_for(lambda: pf.stats()["ready_blocks"] == 1)
        k0, v0 = pf.get((0, 0))
        k1, _ = pf.get((0, 1))  # a synchronous load
    assert len(made) == 4 and k0 is made[0] and v0 is made[1] and k1 is made[2]


def test_on_the_cpu_nothing_is_staged_and_the_copier_is_a_no_op():
    cs = CopyStream("cpu")
    t = torch.arange(4.0)
    moved, done = cs.issue((t,))
    assert not cs.stages and cs.stream is None and done is None and moved[0] is t
    assert cs.wait(moved, done) is moved
    with Prefetcher(throttled(3, rate=1e12), threads=1) as pf:
        pf.request([(0, 0), (0, 1)], device="cpu")
        wait_for(lambda: pf.stats()["ready_blocks"] == 2)
        k, _ = pf.get((0, 0), "cpu")
        st = pf.stats()
    assert torch.equal(k, block(0)[0]) and st["hits"] == 1 and st["staged"] == 0 and st["staged_bytes"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_blocks_are_pinned_and_their_copy_overlaps(monkeypatch):
    def no_sync(*a, **k):
        raise AssertionError("torch.cuda.synchronize called")

    for codec in ("exact", "int8"):
        with Prefetcher(throttled(4, codec=codec, rate=1e12), threads=2) as pf:
            pf.request([(0, i) for i in range(4)], device="cuda")
            wait_for(lambda: pf.stats()["staged_blocks"] == 4)  # noqa: B023
            assert all(e[1].is_pinned() and (e[0] == "coded" or e[2].is_pinned()) for e in pf._ready.values())
            monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
            outs = [pf.get((0, i), "cuda") for i in range(4)]
            monkeypatch.undo()
            st = pf.stats()
            assert st["staged_hits"] == 4 and st["staged_blocks"] == 0
            for i, (k, v) in enumerate(outs):
                ref = pf.store.get((0, i), "cuda")
                assert k.is_cuda and torch.equal(k, ref[0]) and torch.equal(v, ref[1])


# ------------------------------------------------------------------ the cache over a throttled store
def decode(model, cache, steps: int, compute_s: float) -> None:
    tok = torch.full((1, 1), 5)
    with torch.no_grad():
        for _ in range(steps):
            model(tok, cache=cache, use_cache=True)
            tok = (tok * 7 + 3) % 128
            time.sleep(compute_s)  # the rest of a real model's step: look-ahead loads meanwhile


TINY_BLOCK = 2 * 2 * 16 * 16 * 4  # K + V of one block: 2 KV heads x 16 tokens x 16 dims, fp32
TINY_READ_S = 0.02


def tiny_decode_stalls(threads: int, steps: int = 8, compute_s: float = 0.15) -> tuple[dict, tuple[int, float]]:
    """The tiny Llama over a throttled memory tier (fast while the prompt fills it, then
    TINY_READ_S a block, the ready buffer emptied): the decode's {hits, misses, stall_s}
    from cache.stats() and the throttle's (charged bytes, charged seconds) over it."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    stores: list[ThrottledStore] = []
    default_store = flash_cache._default_store

    def throttled_default(cfg, dtype):
        stores.append(ThrottledStore(default_store(cfg, dtype), 1e12))
        return stores[-1]

    c = flashmem.FlashMemoryConfig(
        **dict(SMALL, lsa_keep_ratio=0.3, cold_store="memory", prefetch_threads=threads, prefetch_window=1024)
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash_cache, "_default_store", throttled_default)
        cache = flashmem.attach(model, c)
    with cache:
        store = stores[-1]
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        store.bytes_per_s = TINY_BLOCK / TINY_READ_S
        if cache.prefetcher is not None:
            cache.prefetcher.discard()  # decode reads every block again, at the slow rate
        before, charged0 = cache.stats(), (store.charged_bytes, store.charged_s)
        decode(model, cache, steps, compute_s)
        after = cache.stats()
        charged = (store.charged_bytes - charged0[0], store.charged_s - charged0[1])
    return {k: after[k] - before[k] for k in ("hits", "misses", "stall_s")}, charged


def test_a_tiny_models_decode_stalls_less_with_prefetch():
    """The cache's own counters over a throttled memory tier: without prefetch every block read
    is a synchronous miss whose stall is at least its bytes over the rate; with prefetch the
    same decode stalls less, and most reads are hits."""
    off, (off_bytes, off_s) = tiny_decode_stalls(0)
    on, (on_bytes, on_s) = tiny_decode_stalls(2)
    # off: each block read is a synchronous miss, and the stall covers every charged read
    assert off["hits"] == 0 and off["misses"] > 0
    assert off_bytes == off["misses"] * TINY_BLOCK
    assert off["stall_s"] >= off_s * 0.999 and off_s == pytest.approx(off["misses"] * TINY_READ_S)
    # on: the same decode, most blocks prefetched during the "compute", far less stall; a
    # stall only ever waits on the link, so it is at most the time the link was busy
    assert on["hits"] > on["misses"] > 0 and on_bytes > 0
    assert on["stall_s"] < off["stall_s"] / 2, (on, off)
    assert on["stall_s"] <= on_s + 0.1


def main() -> None:
    """`python tests/test_prefetch_overlap.py`: the figures in docs/accelerator.md, "Prefetch"."""
    steps, compute_s = 5, 2 * READ_S
    for threads, ahead in ((0, False), (2, True)):
        with Prefetcher(throttled(steps + 1), threads=threads) as pf:
            waits = run_steps(pf, steps, compute_s, ahead)
            st = pf.stats()
        print(
            f"step loop, prefetch {'on ' if ahead else 'off'}: stall_s {st['stall_s']:.3f}, hits {st['hits']}, "
            f"misses {st['misses']}, get ms {[round(w * 1e3, 2) for w in waits]}"
        )
    for threads in (0, 2):
        got, (nbytes, secs) = tiny_decode_stalls(threads)
        print(
            f"tiny Llama, prefetch_threads {threads}: stall_s {got['stall_s']:.3f}, hits {got['hits']}, "
            f"misses {got['misses']}, throttle charged {nbytes} B / {secs:.3f} s"
        )


if __name__ == "__main__":
    main()
