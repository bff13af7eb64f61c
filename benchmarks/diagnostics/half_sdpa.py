"""A CPU's SDPA in fp32 and in bf16/fp16, and flashmem's own call (`cache/sdpa.py`), by shape:

    python benchmarks/diagnostics/half_sdpa.py [--dtype bfloat16] [--keys 1024,8192]
        [--queries 1,16,512] [--out FILE]

One torch thread, SmolLM2's heads (9 query heads over 3 KV heads, head dim 64), one row, a
boolean causal mask: ms per call of F.scaled_dot_product_attention in fp32 and in the dtype,
and of `flashmem.cache.sdpa.attention` in the dtype (one query per head: computed in fp32 and
cast back, docs/serving.md, stop 49), the median of `--reps` calls after warm-up. And the
largest difference of each half result from fp64 attention.

    python benchmarks/diagnostics/half_sdpa.py --grouped [--dtypes float32,bfloat16]
        [--keys 100,1100,4000] [--rows 1,8] [--out FILE]

One query per head, `--rows` rows, an additive mask per query head hiding 5 keys: ms per
call of the enable_gqa call and of the grouped one (each KV head's 3 query heads as its
queries, `sdpa._one_query_grouped`), their ratio, and the largest difference between the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from flashmem.cache import sdpa
from flashmem_eval.benchkit import median_ms


def ms(fn: Callable[[], torch.Tensor], reps: int) -> float:
    return median_ms(fn, reps, warm=3)


def shape_row(m: int, L: int, half: torch.dtype, reps: int, g: torch.Generator) -> dict[str, float]:
    """m queries of 9 heads over L keys of 3 KV heads (d 64), a causal boolean mask."""
    name = str(half).removeprefix("torch.")
    q = torch.randn(1, 9, m, 64, generator=g)
    k, v = torch.randn(1, 3, L, 64, generator=g), torch.randn(1, 3, L, 64, generator=g)
    mask = torch.ones(1, 1, m, L, dtype=torch.bool).tril(L - m)
    qh, kh, vh = q.to(half), k.to(half), v.to(half)

    def torch_sdpa(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, scale=0.125, enable_gqa=True)

    def flashmem_sdpa() -> torch.Tensor:
        return sdpa.attention(qh, kh, vh, mask, 0.125, True)

    ref = torch_sdpa(q.double(), k.double(), v.double())
    return {
        "queries": m,
        "keys": L,
        "sdpa_fp32_ms": ms(lambda: torch_sdpa(q, k, v), reps),
        f"sdpa_{name}_ms": ms(lambda: torch_sdpa(qh, kh, vh), reps),
        f"flashmem_{name}_ms": ms(flashmem_sdpa, reps),
        f"sdpa_{name}_max_err": (torch_sdpa(qh, kh, vh).double() - ref).abs().max().item(),
        f"flashmem_{name}_max_err": (flashmem_sdpa().double() - ref).abs().max().item(),
    }


def grouped_row(b: int, L: int, dtype: torch.dtype, reps: int, g: torch.Generator) -> dict[str, float | int | str]:
    """b rows of one query, 9 heads over L keys of 3 KV heads (d 64): enable_gqa against grouped."""
    q = torch.randn(b, 9, 1, 64, generator=g).to(dtype)
    k, v = torch.randn(b, 3, L, 64, generator=g).to(dtype), torch.randn(b, 3, L, 64, generator=g).to(dtype)
    mask = torch.zeros(b, 9, 1, L, dtype=dtype)
    mask[..., -5:] = float("-inf")

    def gqa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)

    def grouped() -> torch.Tensor:
        return sdpa._one_query_grouped(q, k, v, mask, 0.125)

    a, b_ms = ms(gqa, reps), ms(grouped, reps)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "rows": b,
        "keys": L,
        "enable_gqa_ms": a,
        "grouped_ms": b_ms,
        "grouped_over_enable_gqa": b_ms / a,
        "max_diff": (gqa().double() - grouped().double()).abs().max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--keys", default="1024,8192")
    ap.add_argument("--queries", default="1,16,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--grouped", action="store_true", help="one query: enable_gqa against grouped query heads")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="--grouped: the dtypes")
    ap.add_argument("--rows", default="1,8", help="--grouped: the batch sizes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    if args.grouped:
        for dt in args.dtypes.split(","):
            for b in map(int, args.rows.split(",")):
                for L in map(int, args.keys.split(",")):
                    rows.append(grouped_row(b, L, getattr(torch, dt), args.reps, g))
                    print(json.dumps(rows[-1]), flush=True)
    else:
        for m in map(int, args.queries.split(",")):
            for L in map(int, args.keys.split(",")):
                rows.append(shape_row(m, L, getattr(torch, args.dtype), max(3, args.reps // max(1, m // 16)), g))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        out = {"command": "python benchmarks/diagnostics/half_sdpa.py " + " ".join(sys.argv[1:]), "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
