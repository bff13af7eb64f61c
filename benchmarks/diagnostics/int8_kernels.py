"""Two int8 kernels of a CPU decode step, in each form flashmem has used.

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/int8_kernels.py [--tokens 8192] [--heads 3]
        [--head-dim 64] [--queries 3] [--pages 100] [--reps 300] [--json-out FILE]

- The key copy's logits (cache/rerank_codes.py `KeyMirror.logits`): int8 queries against every
  held int8 key, one GEMM per KV head, in the forms of cache/int8_dots.py:
  `query_major`, [nq, d] @ [d, T], and `token_major`, [T, d] @ [d, nq] (the tokens as the GEMM's
  long side) read back transposed, each then copied into query-major fp32 as `logits` does;
  the keys converted to fp32 a chunk at a time and multiplied in fp32 (`float32`, exact: stop 60);
  and the form before stop 55 (the queries padded to 8 rows, query-major). The sums are
  checked equal. Which form is faster depends on the CPU, so flashmem times them at the first
  call of each size (`chosen` gives what this process chose at this one).
- Rows of int8 codes written into a working set in place (cache/working_set.py `_merge_in_place`,
  `compress/page_code.copy_rows`): `index_copy_` of `--pages` rows of P*d int8 codes (before), and
  the same bytes seen as int64 words (now). The results are checked equal.

Defaults are SmolLM2's shape at 8K (3 KV heads of 64, 3 queries each, 16-token pages). Prints
and writes the median microseconds per call of each form and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from flashmem.cache import int8_dots
from flashmem_eval.benchkit import cpu_name, median_ms


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of `reps` calls after 10 warm-up calls."""
    return 1e3 * median_ms(fn, reps, warm=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=3)
    ap.add_argument("--pages", type=int, default=100, help="rows written in place")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h, T, d, nq = a.heads, a.tokens, a.head_dim, a.queries
    keys = torch.randint(-127, 128, (h, T, d), dtype=torch.int8, generator=g)
    q = torch.randint(-127, 128, (h, nq, d), dtype=torch.int8, generator=g)
    rows = max(8, -(-nq // 8) * 8)
    qpad = torch.zeros(h, rows, d, dtype=torch.int8)
    qpad[:, :nq] = q

    def padded() -> torch.Tensor:  # before stop 55
        dots = torch.empty(h, rows, T, dtype=torch.int32)
        for j in range(h):
            torch._int_mm(qpad[j], keys[j].t(), out=dots[j])
        return dots[:, :nq].float()

    def form(name: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:  # as `logits` takes them: fp32 query-major, copied where not already
            sums = int8_dots.dots(keys, q, name)
            return sums if sums.dtype == torch.float32 else torch.empty(h, nq, T).copy_(sums)

        return run

    assert all(torch.equal(padded(), form(f)()) for f in int8_dots.FORMS)
    int8_dots.dots(keys, q)  # this process's choice for the size
    P = a.page_tokens
    n_rows = max(a.pages * 6, 16)  # a working set of about this many pages per layer
    held = torch.zeros(n_rows, P * d, dtype=torch.int8)
    came = torch.randint(-127, 128, (a.pages, P * d), dtype=torch.int8, generator=g)
    dst = torch.randperm(n_rows, generator=g)[: a.pages]
    as_bytes, as_words = held.clone(), held.clone()
    as_bytes.index_copy_(0, dst, came)
    as_words.view(torch.int64).index_copy_(0, dst, came.view(torch.int64))
    assert torch.equal(as_bytes, as_words)
    out = {
        "command": "python benchmarks/diagnostics/int8_kernels.py "
        + f"--tokens {T} --heads {h} --head-dim {d} --queries {nq} --pages {a.pages} --reps {a.reps}",
        "logits_us": {
            **{f: timed(form(f), a.reps) for f in int8_dots.FORMS},
            "query_major_padded_to_8": timed(padded, a.reps),
        },
        "chosen": next(iter(int8_dots.chosen_forms().values())),
        "rows_in_place_us": {
            "index_copy_int8": timed(lambda: held.index_copy_(0, dst, came), a.reps),
            "index_copy_as_int64": timed(
                lambda: held.view(torch.int64).index_copy_(0, dst, came.view(torch.int64)), a.reps
            ),
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # AVX2 / AVX512 / ...: what ATen's kernels use
    }
    lg, rw = out["logits_us"], out["rows_in_place_us"]
    out["token_major_over_query_major"] = lg["token_major"] / lg["query_major"]
    out["float32_over_query_major"] = lg["float32"] / lg["query_major"]
    out["rows_now_over_before"] = rw["index_copy_as_int64"] / rw["index_copy_int8"]
    print(json.dumps({k: v for k, v in out.items() if k != "command"}, indent=1))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
