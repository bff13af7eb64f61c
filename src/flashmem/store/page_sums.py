"""Checksums of short runs of a block, so the disk tier can read single pages and verify them.

A block record carries one xxh64 over its whole payload, which a read of one page cannot
check. With the exact codec the payload is K then V, each [b, h, B, d] in the model dtype, so
the tokens t..t+n of one row and KV head are one contiguous run of bytes. `unit_sums` gives a
64-bit sum per run of `unit_tokens` tokens (a "unit": the cache's page, at least SUM_TOKENS),
computed when the block is put and kept in RAM (8 bytes per unit of one KV head: with 16-token
pages 1/256 of a bf16 block with 64-wide heads, 1/512 of fp32); a page read verifies each of
its units against them. They grow with the context beside the budget (a disk tier is on a CPU
the process's RAM): units of a page, not of 4 tokens, make them a quarter of what they were.

The sum is position-weighted (each 8-byte word times its own odd constant, summed mod 2^64,
then mixed): any change to a single word changes it, and a random change to several is
missed with probability about 2^-64. It catches damaged bytes, not a deliberate forgery (as
xxh64 does not either). Vectorised over a whole block: no Python work per unit.
"""

from __future__ import annotations

import functools

import numpy as np

SUM_TOKENS = 4  # the fewest tokens a checksummed unit has; a page read is whole units
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SUM_ROWS_BYTES = 1 << 17  # bytes of units summed at a time (their products' temporary)


def unit_bytes(shape: tuple[int, ...], itemsize: int, unit_tokens: int = SUM_TOKENS) -> int | None:
    """Bytes of one unit of `unit_tokens` tokens of a block of `shape` [b, h, B, d], or None where
    a block cannot be cut into whole units of whole 8-byte words."""
    if len(shape) != 4 or unit_tokens < 1 or shape[2] % unit_tokens:
        return None
    n = unit_tokens * shape[3] * itemsize
    return n if n % 8 == 0 else None


def unit_sums(units: np.ndarray) -> np.ndarray:
    """units: uint8 [n, unit_bytes] (unit_bytes a multiple of 8) -> uint64 [n]. Summed
    SUM_ROWS_BYTES of units at a time: the products are a temporary as large as what they
    sum, and a page read checks a whole layer's candidates (17 MB at 32K on the tiny model)."""
    words = np.ascontiguousarray(units).view(np.uint64)  # [n, unit_bytes / 8]
    weights = _weights(words.shape[1])
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


@functools.cache
def _weights(n: int) -> np.ndarray:
    """Each of n words' odd constant (a page read sums thousands of small runs a decode step)."""
    with np.errstate(over="ignore"):
        w = (np.arange(n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * _GOLDEN
    w.flags.writeable = False
    return w


def payload_sums(
    payload: np.ndarray, shape: tuple[int, ...], itemsize: int, unit_tokens: int = SUM_TOKENS
) -> np.ndarray | None:
    """Every unit's sum of an exact-codec payload (K then V, uint8 [2 * numel * itemsize]) ->
    uint64 [2 * b * h * B / unit_tokens], units in payload order; None where the block has no
    whole units."""
    n = unit_bytes(shape, itemsize, unit_tokens)
    if n is None or payload.size % n:
        return None
    return unit_sums(payload.reshape(-1, n))
