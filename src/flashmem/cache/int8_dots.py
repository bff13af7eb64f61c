"""Exact int8 dot products of a key copy against a few queries, in the GEMM form this CPU runs faster.

`KeyMirror.logits` (cache/rerank_codes.py) scores every sealed key of a layer: per row and
KV head, T int8 keys [T, d] against the nq int8 queries of its GQA group [nq, d], summed
exactly in int32 by `torch._int_mm`. Two forms give the same sums:

- `query_major`: queries [nq, d] @ keys transposed [d, T] -> [nq, T];
- `token_major`: keys [T, d] @ queries transposed [d, nq] -> [T, nq], the tokens as the
  GEMM's long side, read back transposed.

Which one is faster depends on the CPU's int8 GEMM. One thread, SmolLM2's 8K shape (3 KV
heads of 64, 3 queries each; `benchmarks/diagnostics/int8_kernels.py`): token-major took
0.48x the time of query-major (queries padded to 8 rows) on an Intel Xeon with AMX (stop 55),
and 3.6x the time of query-major on an AMD EPYC with AVX-512 VNNI (stop 58). So the first call
of each size (tokens rounded up to a power of two, d, nq) times both forms on its own inputs,
and the process keeps the faster one for that size. The sums, hence the logits, are the same
either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

FORMS = ("query_major", "token_major")
TIMED_CALLS = 3  # per form, the fastest kept: the forms differ by about 2x on the CPUs measured

_chosen: dict[tuple[int, int, int], str] = {}  # (tokens rounded up to a power of two, d, nq) -> form


def dots(keys: torch.Tensor, queries: torch.Tensor, form: str | None = None) -> torch.Tensor:
    """keys int8 [r, T, d] (r: rows x KV heads; each [T, d] with unit stride along d),
    queries int8 [r, nq, d] -> int32 [r, nq, T] (token-major's is a transposed view).
    form: one of FORMS, or None for the one timed faster on this machine at this size."""
    if form is not None:
        if form not in FORMS:
            raise ValueError(f"int8 dot form {form!r} is not allowed; allowed: {', '.join(FORMS)}")
        return _FORM[form](keys, queries)
    size = (1 << max(keys.shape[1] - 1, 0).bit_length(), keys.shape[2], queries.shape[1])
    chosen = _chosen.get(size)
    if chosen is not None:
        return _FORM[chosen](keys, queries)
    return _choose(size, keys, queries)


def chosen_forms() -> dict[tuple[int, int, int], str]:
    """The forms this process chose so far, by (tokens rounded up to a power of two, d, nq)."""
    return dict(_chosen)


def _choose(size: tuple[int, int, int], keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Time both forms on these inputs (a warm call each, then the fastest of TIMED_CALLS),
    keep the faster for `size` -> its sums."""
    sums, seconds = {}, {}
    for form in FORMS:
        fn = _FORM[form]
        sums[form] = fn(keys, queries)
        seconds[form] = min(_elapsed(fn, keys, queries) for _ in range(TIMED_CALLS))
    best = min(FORMS, key=seconds.__getitem__)
    _chosen[size] = best
    return sums[best]


def _elapsed(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], keys: torch.Tensor, q: torch.Tensor) -> float:
    """Seconds one call of fn takes (a CPU runs it synchronously)."""
    t0 = time.perf_counter()
    fn(keys, q)
    return time.perf_counter() - t0


def _query_major(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    r, T, _ = keys.shape
    out = torch.empty(r, queries.shape[1], T, dtype=torch.int32, device=keys.device)
    for kk, qq, oo in zip(keys.unbind(0), queries.unbind(0), out.unbind(0)):
        torch._int_mm(qq, kk.t(), out=oo)
    return out


def _token_major(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    r, T, _ = keys.shape
    qt = queries.transpose(-1, -2).contiguous()  # [r, d, nq]
    out = torch.empty(r, T, queries.shape[1], dtype=torch.int32, device=keys.device)
    for kk, qq, oo in zip(keys.unbind(0), qt.unbind(0), out.unbind(0)):
        torch._int_mm(kk, qq, out=oo)
    return out.transpose(-1, -2)


_FORM: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "query_major": _query_major,
    "token_major": _token_major,
}
