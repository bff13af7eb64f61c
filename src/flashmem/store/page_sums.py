"""Checksums of short runs of a block, so the disk tier can read single pages and verify them.

A block record carries one xxh64 over its whole payload, which a read of one page cannot
check. With the exact codec the payload is K then V, each [b, h, B, d] in the model dtype, so
the tokens t..t+n of one row and KV head are one contiguous run of bytes. `unit_sums` gives a
64-bit sum per run of SUM_TOKENS tokens (a "unit"), computed when the block is put and kept
in RAM (about 8 bytes per 4 tokens of one KV head: 1/64 of a bf16 block with 64-wide heads);
a page read verifies each of its units against them.

The sum is position-weighted (each 8-byte word times its own odd constant, summed mod 2^64,
then mixed): any change to a single word changes it, and a random change to several is
missed with probability about 2^-64. It catches damaged bytes, not a deliberate forgery (as
xxh64 does not either). Vectorised over a whole block: no Python work per unit.
"""

from __future__ import annotations

import numpy as np

SUM_TOKENS = 4  # tokens per checksummed unit; a page must be a multiple of it
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SUM_ROWS_BYTES = 1 << 20  # units summed at a time (their products' temporary)


def unit_bytes(shape: tuple[int, ...], itemsize: int) -> int | None:
    """Bytes of one unit of a block of `shape` [b, h, B, d], or None where a block cannot be cut
    into whole units of whole 8-byte words."""
    if len(shape) != 4 or shape[2] % SUM_TOKENS:
        return None
    n = SUM_TOKENS * shape[3] * itemsize
    return n if n % 8 == 0 else None


def unit_sums(units: np.ndarray) -> np.ndarray:
    """units: uint8 [n, unit_bytes] (unit_bytes a multiple of 8) -> uint64 [n]. Summed
    SUM_ROWS_BYTES of units at a time: the products are a temporary as large as what they
    sum, and a page read checks a whole layer's candidates (17 MB at 32K on the tiny model)."""
    words = np.ascontiguousarray(units).view(np.uint64)  # [n, unit_bytes / 8]
    weights = (np.arange(words.shape[1], dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * _GOLDEN
    out = np.empty(words.shape[0], dtype=np.uint64)
    step = max(1, SUM_ROWS_BYTES // max(1, words.shape[1] * 8))
    with np.errstate(over="ignore"):
        for i in range(0, words.shape[0], step):
            s = (words[i : i + step] * weights).sum(axis=1, dtype=np.uint64)
            s ^= s >> np.uint64(29)
            s *= _GOLDEN
            s ^= s >> np.uint64(32)
            out[i : i + step] = s
    return out


def payload_sums(payload: np.ndarray, shape: tuple[int, ...], itemsize: int) -> np.ndarray | None:
    """Every unit's sum of an exact-codec payload (K then V, uint8 [2 * numel * itemsize]) ->
    uint64 [2 * b * h * B / SUM_TOKENS], units in payload order; None where the block has no
    whole units."""
    n = unit_bytes(shape, itemsize)
    if n is None or payload.size % n:
        return None
    return unit_sums(payload.reshape(-1, n))
