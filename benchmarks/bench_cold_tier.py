"""Cold-tier read bandwidth: raw sequential file reads vs the disk store's random block reads.

    python benchmarks/bench_cold_tier.py [--dir /tmp] [--mib 256] [--block 128] [--codec exact] [--store disk|lmdb]

Page cache is dropped for the files first (fsync + posix_fadvise DONTNEED), so
both numbers come from the device, not RAM. Prints MB/s and the store/raw ratio
for: synchronous random gets, and gets behind a Prefetcher (request all, then get).
Block shape: [1, kv_heads=3, B, head_dim=64] fp16 (SmolLM2-135M's KV layout).
The store is written, closed, and reopened before each read phase (after the
page-cache drop), so an LMDB map holds no page from an earlier phase either.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from flashmem.store import DiskStore, Prefetcher
from flashmem.store.lmdb_store import LmdbStore
from flashmem_eval.benchkit import drop_segments, raw_sequential

STORES = {"disk": DiskStore, "lmdb": LmdbStore}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--codec", default="exact")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--store", choices=sorted(STORES), default="disk")
    a = ap.parse_args()
    cls = STORES[a.store]

    shape = (1, 3, a.block, 64)
    k = torch.randn(shape, dtype=torch.float16)
    v = torch.randn(shape, dtype=torch.float16)
    raw = raw_sequential(a.dir, a.mib * 2**20)
    print(f"raw sequential read: {raw / 1e6:8.1f} MB/s")

    with cls(a.dir, codec=a.codec, dtype=torch.float16, name="bench", persist=True) as s:
        rec = s.codec.nbytes(shape, torch.float16)
        n = a.mib * 2**20 // rec
        t0 = time.perf_counter()
        for i in range(n):
            s.put((i % 30, i), k, v)
        s.flush()
        wdt = time.perf_counter() - t0
        path = s.path
    print(f"{a.store} store write ({a.codec}, {n} blocks of {rec} B): {n * rec / wdt / 1e6:8.1f} MB/s coded")
    keys = [(i % 30, i) for i in range(n)]
    random.Random(0).shuffle(keys)

    drop_segments(path)
    with cls.reopen(path, persist=True) as s:
        t0 = time.perf_counter()
        for key in keys:
            s.get(key, "cpu")
        dt = time.perf_counter() - t0
        io = s.stats.extra.get("read_s", 0.0)
    bw = n * rec / dt
    print(
        f"store random get, sync:       {bw / 1e6:8.1f} MB/s coded  ratio {bw / raw:5.2f}  "
        f"({dt / n * 1e6:.0f} us/block, of which read {io / n * 1e6:.0f} us; "
        f"read alone {n * rec / io / 1e6:.0f} MB/s)"
    )

    drop_segments(path)
    with cls.reopen(path, persist=False) as s, Prefetcher(s, a.threads, ready_bytes=2**40) as pf:
        t0 = time.perf_counter()
        window = 64
        for j in range(0, n, window):
            pf.request(keys[j + window : j + 2 * window])  # one window ahead
            for key in keys[j : j + window]:
                pf.get(key, "cpu")
        dt = time.perf_counter() - t0
        st = pf.stats()
    bw = n * rec / dt
    print(
        f"store random get, prefetch x{a.threads}: {bw / 1e6:8.1f} MB/s coded  ratio {bw / raw:5.2f}  "
        f"hits {st['hits']:.0f} misses {st['misses']:.0f} stall {st['stall_s']:.2f}s"
    )


if __name__ == "__main__":
    main()
