"""Gaussian scorer: the expected attention mass of a block whose keys are Gaussian.

With keys k ~ N(mu, diag(sigma^2)) in a block, E[exp(s q.k)] = exp(s q.mu +
s^2/2 sum_c q_c^2 sigma_c^2), so a block's log-mass for query q is

    s * (q.mu + s/2 * sum_c q_c^2 sigma_c^2)

(the same moment argument as kvpress's ExpectedAttentionPress, applied to a
block's keys instead of future queries). A needle token among ordinary text
widens the block's spread along the needle's direction, and a query aligned with
it sees that term grow with q_c^2: measured on Gemma3-270m it ranks the needle's
block nearer the top than the mean key alone. Two key-sized vectors per block.
"""

from __future__ import annotations

import torch

from flashmem.index.base import BlockScorer


class GaussianScorer(BlockScorer):
    name = "gaussian"
    vectors = 2

    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        w = valid[:, None, :, None].to(keys.dtype)
        n = w.sum(dim=-2).clamp_min(1)
        mean = (keys * w).sum(dim=-2) / n
        var = (((keys - mean[:, :, None]) ** 2) * w).sum(dim=-2) / n
        return torch.stack([mean, var], dim=-2)  # [b, h, 2, d]

    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        s = queries.shape[-1] ** -0.5 if scaling is None else scaling
        mean, var = summaries[..., 0, :], summaries[..., 1, :]  # [b, h, n, d]
        return torch.matmul(queries, mean.transpose(-1, -2)) + 0.5 * s * torch.matmul(
            queries * queries, var.transpose(-1, -2)
        )  # [b, h, nq, n]
