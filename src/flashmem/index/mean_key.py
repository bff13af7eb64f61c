"""Mean-key scorer: q . (mean key of the block), the cheapest summary (1 vector)."""

from __future__ import annotations

import torch

from flashmem.index.base import BlockScorer


class MeanKeyScorer(BlockScorer):
    name = "mean_key"
    vectors = 1

    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        w = valid[:, None, :, None].to(keys.dtype)
        mean = (keys * w).sum(dim=-2) / w.sum(dim=-2).clamp_min(1)
        return mean[:, :, None, :]  # [b, h, 1, d]

    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        return torch.matmul(queries, summaries[..., 0, :].transpose(-1, -2))  # [b, h, nq, n]
