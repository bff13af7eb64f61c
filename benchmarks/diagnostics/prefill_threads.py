"""Seconds per 256-token SmolLM2 prefill chunk through the cache with N torch threads.

    python benchmarks/diagnostics/prefill_threads.py 1
    python benchmarks/diagnostics/prefill_threads.py 2

On a shared machine whose load average exceeds its cores, more threads than idle
cores make OpenMP threads spin: the README's Serve section quotes a run of both.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import flashmem

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("threads", type=int, nargs="?", default=1, help="torch threads (default 1)")
    threads = ap.parse_args(argv).threads
    torch.set_num_threads(threads)
    model, _ = flashmem.load_model("smollm2")
    cfg = flashmem.FlashMemoryConfig.from_yaml(ROOT / "configs" / "cpu-small.yaml")
    cache = flashmem.attach(model, cfg)
    ids = torch.randint(10, 1000, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for i in range(4):
            t0 = time.perf_counter()
            model(ids[:, i * 256 : (i + 1) * 256], cache=cache, use_cache=True, logits_to_keep=1)
            print(f"threads {threads} chunk {i}: {time.perf_counter() - t0:.2f} s", flush=True)
    cache.close()


if __name__ == "__main__":
    main()
