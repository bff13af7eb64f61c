"""Prefill time of the recipe with every query of a chunk scoring the index vs a sample.

    python benchmarks/diagnostics/prefill_queries_ab.py [--model smollm2] [--tokens 8192] [--budget 0.125]
                                            [--rounds 2] [--threads 1]

One process, the two settings alternating (`lsa_prefill_queries` 0, then 64, repeated),
so load from other jobs falls on both alike. Prints the seconds of each prefill
(`flashmem.prefill`, chunks of the config's prefill_chunk) and the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashmem
from flashmem.texts import load_text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = flashmem.load_model(args.model)
    ids = tok(load_text(), return_tensors="pt").input_ids[:, : args.tokens]
    times: dict[int, list[float]] = {0: [], 64: []}
    for _ in range(args.rounds):
        for n in (0, 64):
            cfg = flashmem.FlashMemoryConfig.for_budget(args.budget, ids.shape[1], model, lsa_prefill_queries=n)
            with flashmem.attach(model, cfg) as cache, torch.no_grad():
                t0 = time.perf_counter()
                flashmem.prefill(model, cache, ids)
                times[n].append(time.perf_counter() - t0)
            print(f"lsa_prefill_queries {n:3d}: {times[n][-1]:.1f} s", flush=True)
    ratio = statistics.median(times[64]) / statistics.median(times[0])
    print(
        f"median prefill: every query {statistics.median(times[0]):.1f} s, 64 queries re-ranked "
        f"{statistics.median(times[64]):.1f} s ({ratio:.2f}x)"
    )


if __name__ == "__main__":
    main()
