"""Prefill time of the recipe on the tiny random Llama (`flashmem_eval.benchkit.tiny_llama_long`), one torch thread:

    python benchmarks/diagnostics/prefill_time.py [--tokens 16384] [--budget 0.125] [--runs 3]

Prints, per run in its own process, the seconds `flashmem.prefill` (chunks of 8192)
takes and `memory_report()["scratch_bytes"]`. Used to compare two versions of the
code run by turns (docs/measurements.md, "Decode cost of the int8 working set, cut").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(tokens: int, budget: float) -> dict:
    import torch

    import flashmem
    from flashmem_eval.benchkit import tiny_llama_long

    torch.set_num_threads(1)
    model = tiny_llama_long(tokens + 8)
    ids = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig.for_budget(budget, tokens, model))
    t0 = time.perf_counter()
    with torch.no_grad():
        flashmem.prefill(model, cache, ids, chunk=8192)
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "prefill_s": seconds, "scratch_bytes": cache.memory_report()["scratch_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.tokens, args.budget)))
        return
    for _ in range(args.runs):  # a fresh process each: the allocator's state is part of the cost
        cmd = [sys.executable, __file__, "--one", "--tokens", str(args.tokens), "--budget", str(args.budget)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        print(out, flush=True)


if __name__ == "__main__":
    main()
