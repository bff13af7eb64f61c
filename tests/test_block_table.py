"""store/block_table.py: a store's per-block bookkeeping in numpy columns behaves as the dicts it
replaced, and costs a disk tier a fraction of their RAM."""

from __future__ import annotations

import gc
import random
import tracemalloc

import numpy as np
import torch

from flashmem.store.block_table import DENSE_SLACK, Arena, BlockSizes, BlockTable, KeyRows
from flashmem.store.disk import DiskStore


def _keys(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Sequential blocks per layer, as the cache puts them, mixed with sparse, negative and far ones."""
    keys = [(layer, b) for layer in range(3) for b in range(n)]
    keys += [
        (rng.randrange(-3, 5), rng.choice([-7, -1, n + DENSE_SLACK + 5, 10**9, rng.randrange(4 * n)])) for _ in range(n)
    ]
    rng.shuffle(keys)
    return keys


def test_key_rows_and_sizes_behave_as_a_dict() -> None:
    rng = random.Random(0)
    rows, sizes, want = KeyRows(), BlockSizes(), {}
    for i, key in enumerate(_keys(rng, 300)):
        rows.set(key, i)
        n = rng.randrange(1, 1 << 40)
        sizes[key] = n
        want[key] = (i, n)
    assert len(rows) == len(sizes) == len(want)
    assert sorted(rows) == sorted(sizes) == sorted(want)
    assert dict(rows.items()) == {k: r for k, (r, _) in want.items()}
    for key, (r, n) in want.items():
        assert rows.get(key) == r and sizes.get(key) == n and key in sizes
    assert sizes.total() == sum(n for _, n in want.values())
    for absent in [(0, 10**6), (7, 0), (-9, -9), (0, 300 + 2 * DENSE_SLACK)]:
        assert absent not in want
        assert rows.get(absent) == -1 and sizes.get(absent, -5) == -5 and absent not in sizes
    assert "x" not in sizes and (1, "a") not in sizes and (1, 2, 3) not in sizes
    # a re-put key keeps one entry, with its new value
    key = next(iter(want))
    sizes[key] = 7
    assert sizes.get(key) == 7 and len(sizes) == len(want)
    again = BlockSizes({k: n for k, (_, n) in want.items()})
    assert sorted(again) == sorted(want) and again.total() == sum(n for _, n in want.values())
    sizes.clear()
    rows.clear()
    assert len(sizes) == len(rows) == 0 and list(sizes) == [] and sizes.get(key) == 0


def test_block_table_rows_layouts_and_sums() -> None:
    t = BlockTable()
    shape, other = ((1, 2, 64, 8), torch.float32), ((1, 2, 32, 8), torch.bfloat16)
    held = {}
    for b in range(200):
        sums = np.arange(b, b + 8, dtype=np.uint64) if b % 3 else None
        lay = shape if b % 5 else other
        t.put((1, b), 0, 64 * b, 512, b * 11, lay, sums)
        held[b] = (lay, sums)
    assert len(t) == 200 and (1, 199) in t and (1, 200) not in t and (2, 0) not in t
    first = t.sums(t.row((1, 1)))
    for b, (lay, sums) in held.items():
        r = t.row((1, b))
        assert t.layout(r) == lay and int(t.offset.data[r]) == 64 * b and int(t.payload_sum.data[r]) == b * 11
        got = t.sums(r)
        assert (got is None) == (sums is None) and (sums is None or np.array_equal(got, sums))
    assert len(t.layouts) == 2
    # a re-put block gets its new record and sums; a view of the old sums keeps its bytes
    t.put((1, 1), 3, 999, 512, 5, shape, np.full(8, 42, dtype=np.uint64))
    r = t.row((1, 1))
    assert len(t) == 200 and int(t.segment.data[r]) == 3 and int(t.offset.data[r]) == 999
    assert np.array_equal(t.sums(r), np.full(8, 42)) and np.array_equal(first, np.arange(1, 9))
    t.clear()
    assert len(t) == 0 and t.row((1, 1)) == -1


def test_the_arena_keeps_runs_whole_and_never_copies_them() -> None:
    """Each run reads back as appended, views taken early stay the values (no chunk is copied or
    written again), chunks double up to CHUNK_MAX, and a run longer than that has its own."""
    a = Arena()
    rng = np.random.default_rng(0)
    runs, views = [], []
    for n in [5, 300, 1, 200, Arena.CHUNK_MAX + 3, 7, *rng.integers(1, 2000, 200).tolist()]:
        v = rng.integers(0, 1 << 63, n, dtype=np.uint64)
        where = a.append(v)
        runs.append((where, v))
        views.append(a.run(*where, n))
    for ((chunk, at), v), view in zip(runs, views):
        assert np.array_equal(a.run(chunk, at, v.size), v) and np.array_equal(view, v)
        assert np.shares_memory(view, a.chunks[chunk])
    sizes = [c.shape[0] for c in a.chunks]
    assert sizes[0] == Arena.CHUNK_MIN and Arena.CHUNK_MAX + 3 in sizes
    assert all(n <= Arena.CHUNK_MAX for n in sizes if n != Arena.CHUNK_MAX + 3)
    assert a.n == sum(v.size for _, v in runs) and a.nbytes() < 2 * 8 * a.n + 8 * Arena.CHUNK_MAX


def test_a_disk_tier_keeps_a_few_hundred_bytes_a_block(tmp_path) -> None:
    """Python objects per block cost a disk tier about 800 traced bytes a block here (923 with
    SmolLM2's blocks: 0.075x its 1/8 budget at 8K); in columns it is the sums and a few dozen bytes.
    Traced: numpy's allocations are traced too, so the sums' arena and the columns count."""
    unit = 16
    with DiskStore(str(tmp_path / "s"), unit_tokens=unit) as s:
        k, v = torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16)
        s.put((99, 0), k, v)
        s.flush()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            n = 2000
            for layer in range(4):
                for b in range(n // 4):
                    s.put((layer, b), k, v)
            s.flush()
            gc.collect()
            grown = sum(x.size_diff for x in tracemalloc.take_snapshot().compare_to(before, "filename"))
        finally:
            tracemalloc.stop()
        sums = 2 * 64 // unit * 8  # K and V: a uint64 per unit
        assert grown / n < 2 * sums + 250, f"{grown / n:.0f} B a block"
        got_k, got_v = s.get((3, 17))
        assert torch.equal(got_k, k) and torch.equal(got_v, v) and len(s) == n + 1 and (3, 17) in s


def test_the_writer_holds_no_payload_once_it_is_written(tmp_path, monkeypatch) -> None:
    """Once a batch is durable the idle writer keeps none of its payloads: a loop variable held
    the last batch (up to 64 blocks) until the next put woke it."""
    import weakref

    from flashmem.store import write_behind

    held: list[weakref.ref] = []
    real = write_behind.WriteBehindCore.enqueue

    def spy(self, item):  # type: ignore[no-untyped-def]
        held.append(weakref.ref(item.payload))
        return real(self, item)

    monkeypatch.setattr(write_behind.WriteBehindCore, "enqueue", spy)
    with DiskStore(str(tmp_path / "s"), unit_tokens=16) as s:
        k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
        for b in range(40):
            s.put((0, b), k, v)
        s.flush()
        gc.collect()
        alive = sum(r() is not None for r in held)
        assert len(held) == 40 and alive == 0, f"{alive} payloads held after the flush"
        assert torch.equal(s.get((0, 39))[0], k)
