"""Where prefill time goes as the context grows (the tiny Llama of benchmarks/bench_scale.py, disk tier).

    python benchmarks/diagnostics/profile_scale.py [--tokens 32768] [--chunk 8192] [--threads 1]
                                       [--prefill-queries N] [--summaries]

Feeds the prompt in model-level chunks, prints each chunk's seconds (flat when
nothing per chunk grows with the context), then cProfile's top functions of the
last chunk.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch

import flashmem
from flashmem_eval.benchkit import tiny_llama_long


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--prefill-queries", type=int, default=0, help="lsa_prefill_queries (0: every query)")
    ap.add_argument("--summaries", action="store_true", help="attend HCA entries (bench_scale: off)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, chunk = args.tokens, args.chunk
    model = tiny_llama_long(n)
    ids = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(0))
    cfg = flashmem.FlashMemoryConfig(
        gpu_cache_limit=1024,
        prefetch_window=1024,
        cold_store="disk",
        cold_dir=args.dir,
        lsa_top_k=16,
        use_summaries=args.summaries,
        lsa_prefill_queries=args.prefill_queries,
    )
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        prof = cProfile.Profile()
        for a in range(0, n, chunk):
            last = a + chunk >= n
            if last:
                prof.enable()
            t0 = time.perf_counter()
            model(ids[:, a : a + chunk], cache=cache, use_cache=True, logits_to_keep=1)
            print(f"tokens {a}-{a + chunk}: {time.perf_counter() - t0:.1f} s", flush=True)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
