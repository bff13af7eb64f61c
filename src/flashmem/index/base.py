"""Block index: small per-block key summaries that rank sealed blocks for a query.

A scorer keeps `vectors` key-sized vectors per block and KV head (see
`flashmem.memory.tiers.INDEX_KEY_VECTORS`) and scores them against queries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BlockScorer(ABC):
    name: str
    vectors: int

    @abstractmethod
    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """keys: [b, h, B, d], valid: [b, B] bool -> summary [b, h, vectors, d]."""

    @abstractmethod
    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """queries: [b, h, nq, d] (a GQA group's queries under their KV head);
        summaries: [b, h, n_blocks, vectors, d] -> scores [b, h, nq, n_blocks]
        on the scale of q.k (before the attention scaling `scaling`, d**-0.5 if None)."""
