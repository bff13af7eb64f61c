"""The working set's pages coded on the device (`working_set_codec`).

A step's selected pages are the largest resident tier at small budgets (70% of
the recipe's budget). Kept as int8 rows (one fp32 scale per token and KV head,
symmetric) they take 1 + 4/d bytes per element instead of the model's 2 or 4,
so the same resident bytes hold about 1.9x (bf16) or 3.8x (fp32) the pages. A
step decodes them to the model's dtype for its attention: a transient of one
layer's working set at a time, as the chunk's own activations are.
"""

from __future__ import annotations

import torch


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> codes int8 [..., d] and scales fp32 [..., 1]: x ~= codes * scale,
    |x - x^| <= scale / 2 per element."""
    codes, scale, _ = encode_and_decode(x, None)
    return codes, scale


def encode_and_decode(
    x: torch.Tensor, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """encode(x) and, for `dtype`, decode(codes, scale, dtype) from the same pass: the
    rounded values are the codes before their conversion to int8 (None: no decode)."""
    x = x.detach()
    # max |x| as max(max, -min): two reductions, no |x| temporary (a quarter of the coding's time)
    scale = torch.maximum(x.amax(-1, keepdim=True), x.amin(-1, keepdim=True).neg_()).float().div_(127.0)
    # an all-zero row divides 0 by a tiny scale: codes 0 (one op where a guarded reciprocal took
    # four, each a launch on an accelerator). |x / scale| <= 127 up to rounding, so round() stays
    # in [-127, 127]: no clamp
    rounded = torch.div(x, scale.clamp_min(torch.finfo(torch.float32).tiny)).round_()
    codes = rounded.to(torch.int8)
    if dtype is None:
        return codes, scale, None
    plain = rounded.mul_(scale)
    return codes, scale, plain if dtype == torch.float32 else plain.to(dtype)


def decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8 [..., d], scale [..., 1] -> [..., d] in `dtype`."""
    # in place after the one conversion: a second full-size temporary costs more than the
    # multiply on CPU (fresh allocations of this size fault their pages in)
    out = codes.to(torch.float32).mul_(scale)
    return out if dtype == torch.float32 else out.to(dtype)


def copy_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst[rows] = src along dim 0, in place: dst [n, w], src [len(rows), w] (converted to dst's
    dtype). int8 rows (codes) move as int64 words where their width and alignment allow:
    PyTorch 2.13's CPU index_copy_ of 100 rows of 1,024 int8 codes took 5x the time of the same
    bytes as int64 (one thread, a Xeon: benchmarks/diagnostics/int8_kernels.py); the bytes
    written are the same."""
    if dst.dtype == torch.int8 and src.dtype == torch.int8 and _words(dst) and _words(src):
        dst.view(torch.int64).index_copy_(0, rows, src.view(torch.int64))
        return
    dst.index_copy_(0, rows, src.to(dst.dtype))


def _words(t: torch.Tensor) -> bool:
    """Whether a 2-D int8 tensor can be seen as int64 rows: contiguous rows of a multiple of 8
    bytes, starting on an 8-byte boundary of its storage."""
    return (
        t.dim() == 2
        and t.stride(-1) == 1
        and t.shape[-1] % 8 == 0
        and t.stride(0) % 8 == 0
        and t.storage_offset() % 8 == 0
    )
