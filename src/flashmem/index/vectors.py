"""Resident index vectors in the configured precision (`lsa_index_dtype`).

A scorer's summaries (`[b, h, pages, vectors, width]`) are the one part of the
index that grows with the context, so they are what low precision saves:
`model` keeps the model dtype, `float16` halves fp32, `int8` stores one byte
per element plus one fp16 absmax scale per vector (symmetric; a scorer's
ranking changes little, measured in docs/measurements.md). Vectors are
dequantized for scoring only; nothing dequantized is kept. `summarize_pages`
makes a scorer's summaries of newly sealed pages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flashmem.index.base import BlockScorer


class IndexVectors:
    def __init__(
        self, batch: int, heads: int, vectors: int, width: int, precision: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.precision = precision
        store = {"int8": torch.int8, "float16": torch.float16}.get(precision, dtype)
        self.codes = torch.zeros(batch, heads, 0, vectors, width, dtype=store, device=device)
        self.scales: torch.Tensor | None = None
        if precision == "int8":
            self.scales = torch.zeros(batch, heads, 0, vectors, dtype=torch.float16, device=device)

    @property
    def count(self) -> int:
        """Pages (or blocks) indexed."""
        return self.codes.shape[2]

    def extend(self, summaries: torch.Tensor) -> None:
        """Append summaries [b, h, m, vectors, width] of m new pages."""
        if self.scales is None:
            self.codes = torch.cat([self.codes, summaries.to(self.codes.dtype)], dim=2)
            return
        s = summaries.float()
        scale = (s.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)  # [b, h, m, vectors]
        codes = (s / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
        self.codes = torch.cat([self.codes, codes], dim=2)
        self.scales = torch.cat([self.scales, scale.to(torch.float16)], dim=2)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """All summaries [b, h, n, vectors, width] in `dtype` (dequantized if coded)."""
        if self.scales is None:
            return self.codes.to(dtype)
        return (self.codes.to(torch.float32) * self.scales.to(torch.float32)[..., None]).to(dtype)

    def converted_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the copy `score` makes of the vectors in `dtype` to score them (int8, or
        float16 under another dtype; 0 when they are held in it): written, then read back. A
        scorer without `score_coded` decodes int8 through fp32 first, which copies more."""
        if self.codes.dtype == dtype:
            return 0
        return self.codes.numel() * dtype.itemsize

    def score(self, scorer: BlockScorer, queries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """scorer.score over every summary: int8 summaries by the scorer's `score_coded` where it
        has one (the scales applied to the scores), else decoded (`read`) first."""
        if self.scales is not None:
            got = scorer.score_coded(queries, self.codes, self.scales, scaling)
            if got is not None:
                return got
        return scorer.score(queries, self.read(queries.dtype), scaling)

    def nbytes(self) -> int:
        return self.codes.nbytes + (0 if self.scales is None else self.scales.nbytes)


def summarize_pages(scorer: BlockScorer, k: torch.Tensor, valid: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Index summaries of every page of newly sealed blocks: k [b, h, T, d], valid [b, T]
    -> [b, h, T // P, vectors, d]. Pages go through the scorer as one batch."""
    b, h, T, d = k.shape
    m = T // page_tokens
    pages = k.view(b, h, m, page_tokens, d).transpose(1, 2).reshape(b * m, h, page_tokens, d)
    summ = scorer.summarize(pages, valid.reshape(b * m, page_tokens))  # [b*m, h, vectors, d]
    return summ.view(b, m, h, *summ.shape[2:]).transpose(1, 2)
