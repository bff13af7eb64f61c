"""Prefetcher: hits, misses, stall time, de-duplication, threads=0, thread safety."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from flashmem.errors import ChecksumError
from flashmem.store import DiskStore, LayeredStore, MemoryStore, Prefetcher
from flashmem.store.format import HEADER_SIZE

SHAPE = (1, 2, 64, 32)


def block(layer: int, idx: int):
    g = torch.Generator().manual_seed(layer * 100003 + idx)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


class SlowStore(MemoryStore):
    """A memory store whose reads take `delay` seconds (a slow disk)."""

    def __init__(self, delay: float, **kw) -> None:
        super().__init__(**kw)
        self.delay = delay

    def get(self, key, device=None):
        time.sleep(self.delay)
        return super().get(key, device)


def wait_ready(pf: Prefetcher, n: int, timeout: float = 10.0) -> None:
    end = time.time() + timeout
    while pf.stats()["ready_blocks"] < n:
        assert time.time() < end, pf.stats()
        time.sleep(0.005)


def filled(store, n=8, layer=0):
    for i in range(n):
        store.put((layer, i), *block(layer, i))
    store.flush()
    return store


def test_prefetched_blocks_are_hits(tmp_path):
    with DiskStore(str(tmp_path), codec="int8") as s, Prefetcher(filled(s), threads=2) as pf:
        assert pf.request([(0, i) for i in range(4)]) == 4
        wait_ready(pf, 4)
        for i in range(4):
            k, v = pf.get((0, i), "cpu")
            assert torch.equal(k, s.get((0, i))[0]) and torch.equal(v, s.get((0, i))[1])
        k, _ = pf.get((0, 6), "cpu")  # not requested: a synchronous miss
        assert torch.equal(k, s.get((0, 6))[0])
        st = pf.stats()
        assert st["hits"] == 4 and st["misses"] == 1 and st["late"] == 0
        assert st["disk_bytes_read"] > 0 and st["disk_bytes_written"] > 0


def test_requests_are_deduplicated_and_unknown_keys_skipped():
    s = filled(SlowStore(0.05))
    with Prefetcher(s, threads=2) as pf:
        assert pf.request([(0, 1), (0, 1), (0, 2)]) == 2
        assert pf.request([(0, 1), (0, 99)]) == 0  # in flight / not in the store
        wait_ready(pf, 2)
        assert pf.request([(0, 2)]) == 0  # already ready
        assert pf.stats()["loaded"] == 2


def test_miss_counts_stall_time():
    s = filled(SlowStore(0.05))
    with Prefetcher(s, threads=1) as pf:
        pf.request([(0, 3)])
        k, _ = pf.get((0, 3))  # in flight: waits for it (late)
        assert torch.equal(k, block(0, 3)[0])
        pf.get((0, 4))  # never requested
        st = pf.stats()
        assert st["misses"] == 2 and st["late"] == 1 and st["hits"] == 0
        assert st["stall_s"] >= 0.05


class GatedStore(MemoryStore):
    """A memory store that logs the order of its reads; the first waits for `gate`."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.order: list[int] = []

    def get(self, key, device=None):
        if not self.order:
            self.order.append(-1)  # the first read is taken at once: hold the loader on it
            assert self.gate.wait(10)
            self.order.pop()
        self.order.append(key[1])
        return super().get(key, device)


def wait_reading(s: GatedStore) -> None:
    """Until the loader holds the first read at the gate."""
    end = time.time() + 10
    while s.order != [-1]:
        assert time.time() < end
        time.sleep(0.005)


@pytest.mark.parametrize("urgent_first", [True, False])
def test_urgent_loads_go_before_queued_look_ahead(urgent_first):
    s = filled(GatedStore(), n=8)
    with Prefetcher(s, threads=1) as pf:
        pf.urgent_first = urgent_first
        pf.request([(0, i) for i in range(5)])  # look-ahead: 0 is taken by the loader, 1-4 wait
        wait_reading(s)
        pf.request([(0, 7), (0, 3)], urgent=True)  # a step needs 7 and 3 (3 already queued)
        s.gate.set()
        k, _ = pf.get((0, 7))
        assert torch.equal(k, block(0, 7)[0])
        wait_ready(pf, 6)  # 0-4 parked (3 too: asked for, not yet taken), 7 kept after use
        if urgent_first:
            assert s.order == [0, 7, 3, 1, 2, 4]  # each block read once
        else:
            assert s.order == [0, 1, 2, 3, 4, 7]
        assert pf.stats()["loaded"] == 6


@pytest.mark.parametrize("keep", [True, False])
def test_a_used_block_stays_ready_until_evicted(keep):
    s = filled(MemoryStore(), n=8)
    one = s.nbytes() // 8
    with Prefetcher(s, threads=1, ready_bytes=2 * one) as pf:
        pf.keep_used = keep
        pf.get((0, 1))  # a miss: read synchronously, then kept (or not)
        assert pf.request([(0, 1)]) == (0 if keep else 1)  # look-ahead asks for it again
        k, _ = pf.get((0, 1))  # selected again
        assert torch.equal(k, block(0, 1)[0])
        st = pf.stats()
        assert st["loaded"] == (1 if keep else 2)  # one read from the store, or two
        if keep:
            assert st["hits"] == 1
            pf.request([(0, 2), (0, 3)])
            wait_ready(pf, 2)
            while pf.stats()["evicted"] < 1:
                time.sleep(0.005)
            pf.get((0, 1))  # least recently used: evicted by 2 and 3
            assert pf.stats()["misses"] == 2


def test_get_moves_a_queued_block_ahead_of_look_ahead():
    s = filled(GatedStore(), n=8)
    with Prefetcher(s, threads=1) as pf:
        pf.request([(0, i) for i in range(6)])
        wait_reading(s)
        done = threading.Event()
        threading.Thread(target=lambda: (pf.get((0, 5)), done.set()), daemon=True).start()
        time.sleep(0.05)  # the getter is waiting on block 5's queued load
        s.gate.set()
        assert done.wait(10)
        assert s.order[:2] == [0, 5]


def test_threads_zero_is_synchronous():
    s = filled(MemoryStore())
    with Prefetcher(s, threads=0) as pf:
        assert pf.request([(0, 0), (0, 1)]) == 0
        k, v = pf.get((0, 1), "cpu")
        assert torch.equal(v, block(0, 1)[1])
        st = pf.stats()
        assert st["hits"] == 0 and st["misses"] == 1 and st["memory_gets"] == 1


def test_ready_buffer_is_bounded():
    s = filled(MemoryStore(), n=8)
    one = s.nbytes() // 8
    with Prefetcher(s, threads=1, ready_bytes=3 * one) as pf:
        pf.request([(0, i) for i in range(8)])
        end = time.time() + 10
        while (st := pf.stats())["ready_blocks"] + st["evicted"] < 8:
            assert time.time() < end, st
        assert st["ready_blocks"] == 3 and st["evicted"] == 5 and st["ready_bytes"] <= 3 * one


def test_layered_prefetch_reads_disk_once(tmp_path):
    disk = DiskStore(str(tmp_path))
    with LayeredStore(disk, ram_bytes=0) as s, Prefetcher(filled(s), threads=2) as pf:
        pf.request([(0, 5)])
        wait_ready(pf, 1)
        assert torch.equal(pf.get((0, 5))[0], block(0, 5)[0])
        assert pf.stats()["hits"] == 1 and pf.stats()["disk_gets"] == 1


def test_damaged_block_raises_through_prefetch(tmp_path):
    with DiskStore(str(tmp_path)) as s, Prefetcher(filled(s, n=3), threads=1) as pf:
        rec = HEADER_SIZE + 2 * torch.Size(SHAPE).numel() * 4
        with open(os.path.join(s.path, "seg-000000.dat"), "r+b") as f:
            f.seek(rec + HEADER_SIZE + 8)
            f.write(b"\x12\x34")
        pf.request([(0, 1)])
        with pytest.raises(ChecksumError, match=r"block 1\)"):
            pf.get((0, 1))
        with pytest.raises(ChecksumError):  # and again: never a wrong block
            pf.get((0, 1))


def test_concurrent_request_and_get(tmp_path):
    with DiskStore(str(tmp_path), sync=False) as s, Prefetcher(filled(s, n=32), threads=2) as pf:
        errors: list[BaseException] = []

        def worker(offset: int) -> None:
            try:
                for r in range(3):
                    keys = [(0, (offset + j + r) % 32) for j in range(8)]
                    pf.request(keys)
                    for key in keys:
                        k, v = pf.get(key, "cpu")
                        want = block(*key)
                        assert torch.equal(k, want[0]) and torch.equal(v, want[1])
            except BaseException as exc:  # pragma: no cover
                errors.append(exc)

        ts = [threading.Thread(target=worker, args=(o,)) for o in (0, 5, 11, 20)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        st = pf.stats()
        assert st["hits"] + st["misses"] == 4 * 3 * 8
