"""Exact int8 dot products of a key copy against a few queries, in the GEMM form this CPU runs faster.

`KeyMirror.logits` (cache/rerank_codes.py) scores every sealed key of a layer: per row and
KV head, T int8 keys [T, d] against the nq int8 queries of its GQA group [nq, d], summed
exactly in int32 by `torch._int_mm`. Two forms give the same sums:

- `query_major`: queries [nq, d] @ keys transposed [d, T] -> [nq, T];
- `token_major`: keys [T, d] @ queries transposed [d, nq] -> [T, nq], the tokens as the
  GEMM's long side, read back transposed;
- `float32`: the keys converted to fp32 a chunk at a time (a reused scratch buffer of at most
  FLOAT_CHUNK_ELEMENTS, so it does not grow with the context) and multiplied by the fp32
  queries. Every partial sum is an integer below 2^24 while d <= FLOAT_EXACT_MAX_D, so fp32
  holds it exactly, in any order of summation: the same sums as int32.

Which one is faster depends on the CPU's int8 GEMM. One thread, SmolLM2's 8K shape (3 KV
heads of 64, 3 queries each; `benchmarks/diagnostics/int8_kernels.py`): token-major took
0.48x the time of query-major (queries padded to 8 rows) on an Intel Xeon with AMX (stop 55),
and 3.6x the time of query-major on an AMD EPYC with AVX-512 VNNI (stop 58). On an AMD EPYC
with AVX2 only (no VNNI, stop 60) both int8 forms took 3.3-3.6 ms and `float32` 0.66 ms. So
the first call of each size (tokens rounded up to a power of two, d, nq) times the forms on
its own inputs, and the process keeps the fastest for that size. The sums, hence the logits,
are the same whichever it keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flashmem.cache.scratch import thread_scratch

FORMS = ("query_major", "token_major", "float32")
TIMED_CALLS = 3  # per form, the fastest kept: the forms differ by 2-5x on the CPUs measured
FLOAT_EXACT_MAX_D = 1024  # d * 128 * 128 <= 2^24: fp32 holds every partial sum exactly
FLOAT_CHUNK_ELEMENTS = 1 << 21  # the float32 form's scratch: 8 MB of fp32 keys at most

_chosen: dict[tuple[int, int, int], str] = {}  # (tokens rounded up to a power of two, d, nq) -> form


def dots(keys: torch.Tensor, queries: torch.Tensor, form: str | None = None) -> torch.Tensor:
    """keys int8 [r, T, d] (r: rows x KV heads; each [T, d] with unit stride along d),
    queries int8 [r, nq, d] -> the exact sums [r, nq, T]: int32 (token-major's a transposed
    view), or fp32 holding the same integers (float32, contiguous).
    form: one of FORMS, or None for the one timed fastest on this machine at this size."""
    if form is not None:
        if form not in FORMS:
            raise ValueError(f"int8 dot form {form!r} is not allowed; allowed: {', '.join(FORMS)}")
        if form == "float32" and keys.shape[2] > FLOAT_EXACT_MAX_D:
            raise ValueError(f"int8 dot form float32 is exact up to d={FLOAT_EXACT_MAX_D}; got d={keys.shape[2]}")
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
    """Time the forms on these inputs (a warm call each, then the fastest of TIMED_CALLS),
    keep the fastest for `size` -> its sums, from one more call of it (every call's sums are
    freed before the next: each is the logits' size, which grows with the context)."""
    seconds = {}
    forms = FORMS if keys.shape[2] <= FLOAT_EXACT_MAX_D else FORMS[:2]
    for form in forms:
        fn = _FORM[form]
        fn(keys, queries)  # a warm-up call, its sums dropped
        seconds[form] = min(_elapsed(fn, keys, queries) for _ in range(TIMED_CALLS))
    best = min(forms, key=seconds.__getitem__)
    _chosen[size] = best
    return _FORM[best](keys, queries)


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


def _float32(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    r, T, d = keys.shape
    qf = queries.float()  # [r, nq, d]
    out = torch.empty(r, queries.shape[1], T, device=keys.device)
    chunk = max(256, FLOAT_CHUNK_ELEMENTS // max(r * d, 1))
    buf = thread_scratch().take("int8_dots", (r * min(chunk, T) * d,), torch.float32, keys.device)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        kf = buf[: r * (e - s) * d].view(r, e - s, d)
        kf.copy_(keys[:, s:e])  # int8 -> fp32, cache-sized
        torch.bmm(qf, kf.transpose(1, 2), out=out[:, :, s:e])
    return out


_FORM: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "query_major": _query_major,
    "token_major": _token_major,
    "float32": _float32,
}
