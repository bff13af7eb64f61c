"""A prompt's transients on the device, by length: the bytes alive at once beyond the cache's
state, counted on the CPU as `torch.cuda.max_memory_allocated` counts them on a GPU
(flashmem_eval/live_bytes.py; the cold tier, host memory on a GPU, left out).

The first H200 run (results/gpu_check_h200.json) held 19.0 GB at 128K against DynamicCache's
6.6 GB: prompt chunks past `prefill_exact_tokens` scored every page with every query at once.
This runs a random-weight model with Llama-3.1-8B's attention geometry (32 query heads, 8 KV
heads of 128; small hidden size, fp32, one layer) through `flashmem.prefill` in 8,192-token
forwards with the accelerator's 4,096-token chunks, the recipe at `--budget`, and the exact
prompt capped at `--exact-tokens` so that the chunks after it select:

    python benchmarks/diagnostics/prompt_transients.py --lengths 8192,16384,32768 --out results/prompt_transients.json

`--score-block-bytes 1e12` scores a chunk's queries whole again (as before 2026-12-04).
`--accelerator-bounds` lifts the CPU's own bounds on a step's transients (a prompt chunk's mask
and index scores, 8 MiB here; a decode step's keys and values, 4 MiB) to an accelerator's, so
the count is what a GPU would hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: gpu_check's geometry

import flashmem  # noqa: E402
import gpu_check as gc  # noqa: E402
from flashmem.cache import assembly, scratch  # noqa: E402
from flashmem.cache.attach import ACCELERATOR_PREFILL_CHUNK  # noqa: E402
from flashmem.cache.scratch import thread_scratch  # noqa: E402
from flashmem.index import selection  # noqa: E402
from flashmem_eval.live_bytes import LiveBytes  # noqa: E402


def measure(tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    dims = dict(gc.LLAMA_8B, hidden_size=512, intermediate_size=1024, vocab_size=1024)
    model = gc.build_llama(dims, 1, torch.float32, torch.device("cpu"))
    cfg = flashmem.FlashMemoryConfig.for_budget(
        args.budget,
        tokens,
        model,
        lsa_layer_shares=None,
        cold_store="memory",
        prefill_chunk=ACCELERATOR_PREFILL_CHUNK,
        prefill_exact_tokens=args.exact_tokens,
    )
    cache = flashmem.attach(model, cfg)
    thread_scratch().clear()  # each length counts its own attention buffers
    ids = torch.randint(0, dims["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    with torch.no_grad(), LiveBytes(by_caller=True, exclude=("store.",)) as live:
        flashmem.prefill(model, cache, ids, chunk=8192)
    cache.close()
    full = tokens * 8 * 128 * 4 * 2  # one layer's K and V, fp32
    return {
        "tokens": tokens,
        "full_cache_bytes": full,
        "peak_bytes": live.peak,
        "state_bytes": live.live,
        "transient_bytes": live.peak - live.live,
        "transient_over_full_cache": (live.peak - live.live) / full,
        "at_peak": live.summary(6)["at_peak"],
        "seconds": time.perf_counter() - t0,
    }


def accelerator_bounds() -> None:
    """The bounds a GPU's steps take, on this CPU: its transients then count as they would there."""
    assembly.DECODE_KV_BYTES = assembly.DECODE_KV_BYTES_ACCELERATOR
    scratch.CPU_TRANSIENT_BYTES = assembly.MASK_BYTES
    selection.SCORE_BLOCK_BYTES_CPU = selection.SCORE_BLOCK_BYTES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--budget", type=float, default=1 / 16)
    ap.add_argument("--exact-tokens", type=int, default=4096, help="prefill_exact_tokens (default 4096)")
    ap.add_argument("--score-block-bytes", type=float, default=None, help="index scores held at once")
    ap.add_argument("--accelerator-bounds", action="store_true", help="an accelerator's bounds on transients")
    ap.add_argument("--out", default=None, help="results JSON path")
    args = ap.parse_args(argv)
    if args.accelerator_bounds:
        accelerator_bounds()
    if args.score_block_bytes is not None:
        selection.SCORE_BLOCK_BYTES = int(args.score_block_bytes)
    rows = []
    for tokens in (int(x) for x in args.lengths.split(",")):
        r = measure(tokens, args)
        rows.append(r)
        top = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in list(r["at_peak"].items())[:4])
        print(
            f"{tokens:>7} tokens: transient {r['transient_bytes'] / 2**20:.0f} MiB "
            f"({r['transient_over_full_cache']:.2f}x the layer's full cache); at the peak (MiB): {top}",
            flush=True,
        )
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        meta["score_block_bytes"] = selection.SCORE_BLOCK_BYTES
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
