"""Block index: small per-block key summaries that rank sealed blocks for a query.

A scorer is registered in `flashmem.policies.SCORERS`, which declares its
resident bytes (`vectors` key-sized vectors per block and KV head, or its own
`index_bytes`); `memory/tiers.py` and the calculator read that declaration.
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
    vectors: int  # key-sized vectors per block in `summarize`'s output

    def __init__(self, ctx: ScorerContext | None = None) -> None:
        self.ctx = ctx

    @abstractmethod
    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """keys: [b, h, B, d], valid: [b, B] bool -> summary [b, h, vectors, d]."""

    @abstractmethod
    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """queries: [b, h, nq, d] (a GQA group's queries under their KV head);
        summaries: [b, h, n_blocks, vectors, d] -> scores [b, h, nq, n_blocks]
        on the scale of q.k (before the attention scaling `scaling`, d**-0.5 if None)."""
