"""Block index: small per-block key summaries that rank sealed blocks for a query.

A scorer is registered in `flashmem.policies.SCORERS`, which declares its
resident bytes (`vectors` key-sized vectors per block and KV head, or its own
`index_bytes`); `sizing/tiers.py` and the calculator read that declaration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashmem.config import FlashMemoryConfig


@dataclass(frozen=True)
class ScorerContext:
    """What a scorer may know about the layer it indexes, given at construction."""

    layer_idx: int
    kv_heads: int
    head_dim: int
    cfg: FlashMemoryConfig
    calibration: Any | None = None  # per-layer calibration data of a learned scorer


class BlockScorer(ABC):
    name: str
    vectors: int  # vectors per page (or block) in `summarize`'s output
    uses_hca_entries = False  # True: scores the resident HCA entries instead of summaries

    def __init__(self, ctx: ScorerContext | None = None) -> None:
        self.ctx = ctx

    @property
    def width(self) -> int | None:
        """Elements per summary vector; None: the head dim (key-sized vectors)."""
        return None

    @abstractmethod
    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """keys: [b, h, P, d] (one page, or block), valid: [b, P] bool -> summary [b, h, vectors, width]."""

    @abstractmethod
    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """queries: [b, h, nq, d] (a GQA group's queries under their KV head);
        summaries: [b, h, n_pages, vectors, width] -> scores [b, h, nq, n_pages]
        on the scale of q.k (before the attention scaling `scaling`, d**-0.5 if None)."""

    def score_coded(
        self, queries: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scaling: float | None = None
    ) -> torch.Tensor | None:
        """`score` of int8 summaries codes [b, h, n_pages, vectors, width] with a scale per
        vector scales [b, h, n_pages, vectors], without decoding them first; None: this scorer
        needs them decoded (IndexVectors.read)."""
        return None
