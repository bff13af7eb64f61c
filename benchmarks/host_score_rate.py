"""The re-rank's score on a CPU core, as a fraction of the same core's large-GEMM rate.

The hardware model (flashmem.sizing.hardware) charges a host-side re-rank its FLOPs at
`HOST_FLOPS_FRACTION` of a server CPU's peak. This measures that fraction for the score's
shape: one decode query per head, a GQA group of `--group` query heads per KV head, scored
against n candidate keys (`index/rerank.py`'s exact_page_mass: qg [b, h, group, d] @
K^T [b, h, d, n], fp32 on the host). The reference is a 2048^3 fp32 GEMM on the same core,
which reaches near the core's FMA peak; the ratio is the score's efficiency.

    OMP_NUM_THREADS=1 python benchmarks/host_score_rate.py --out results/host_score_rate.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch


def rate(fn: Callable[[], object], flops: float, reps: int) -> float:
    """FLOP/s of fn, best of three timings of `reps` calls after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, time.perf_counter() - t0)
    return flops * reps / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", default="2048,16384,65536", help="candidate keys per KV head, comma-separated")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = rate(lambda: a @ b, 2.0 * 2048**3, 5)
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        q = torch.randn(1, args.kv_heads, args.group, args.head_dim)  # [b, h, group, d]
        k = torch.randn(1, args.kv_heads, n, args.head_dim)  # [b, h, n, d]
        flops = 2.0 * args.kv_heads * args.group * args.head_dim * n
        score = rate(lambda q=q, k=k: torch.matmul(q, k.transpose(-1, -2)), flops, 10)
        rows.append({"candidate_tokens": n, "score_flops_per_s": score, "fraction_of_gemm": score / gemm})
        print(f"n={n}: score {score / 1e9:.2f} GFLOP/s = {score / gemm:.3f} x the core's GEMM ({gemm / 1e9:.1f})")
    out = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/host_score_rate.py",
        "torch": torch.__version__,
        "threads": 1,
        "shape": {"kv_heads": args.kv_heads, "group": args.group, "head_dim": args.head_dim, "dtype": "float32"},
        "gemm_2048_flops_per_s": gemm,
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
