"""What a disk tier keeps in RAM for each block it holds, beside the block (its record's place, its
layout, its unit sums): traced bytes a block (Python's and numpy's allocations, `tracemalloc`)
after putting `--layers` x `--blocks` blocks of one shape, and that over a budget's bytes.

    python benchmarks/diagnostics/store_bookkeeping.py [--layers 30] [--blocks 128] \\
        [--shape 1,3,64,64] [--page-tokens 16] [--budget-mib 45]

The defaults are SmolLM2's blocks at 8K tokens (fp32, 30 layers of 3 KV heads x 64, 64-token
blocks, 16-token pages) and its 1/8 budget (45 MiB). With `PYTHONPATH` at another tree's `src`
it measures that tree's store.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import tracemalloc

import torch

from flashmem.config import FlashMemoryConfig
from flashmem.store import open_store


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--blocks", type=int, default=128, help="blocks a layer")
    p.add_argument("--shape", default="1,3,64,64", help="a block's K (and V) shape: b,h,B,d (fp32)")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--budget-mib", type=float, default=45.0, help="the budget the bytes are put over")
    a = p.parse_args(argv)
    shape = tuple(int(x) for x in a.shape.split(","))
    if len(shape) != 4 or min(shape) < 1:
        raise SystemExit(f"--shape {a.shape!r}: allowed: four positive integers b,h,B,d")
    k, v = torch.randn(shape), torch.randn(shape)
    with tempfile.TemporaryDirectory(prefix="bookkeeping_") as cold:
        cfg = FlashMemoryConfig(
            cold_store="disk", cold_dir=cold, cold_pending_mb=4, hca_chunk_size=shape[2], lsa_page_tokens=a.page_tokens
        )
        store = open_store(cfg, dtype=torch.float32, name="bookkeeping")
        store.put((-1, 0), k, v)  # the store's own first allocations, before the count
        store.flush()
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for layer in range(a.layers):
            for block in range(a.blocks):
                store.put((layer, block), k, v)
        store.flush()
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        store.close()
    n = a.layers * a.blocks
    row = {
        "blocks": n,
        "shape": list(shape),
        "page_tokens": a.page_tokens,
        "traced_bytes": grown,
        "bytes_a_block": round(grown / n, 1),
        "over_budget": round(grown / (a.budget_mib * 2**20), 4),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
