"""Quest-style scorer: per-channel min/max of a block's keys bound q.k from above.

For each channel, max(q_c * min_c, q_c * max_c) is the largest contribution any
key of the block can make, so the sum is an upper bound of q.k over the block
(Tang et al., 2024, "Quest: Query-Aware Sparsity for Long-Context Inference").
"""

from __future__ import annotations

import torch

from flashmem.index.base import BlockScorer


class QuestScorer(BlockScorer):
    name = "quest"
    vectors = 2

    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        m = valid[:, None, :, None]
        big = torch.finfo(keys.dtype).max
        kmin = keys.masked_fill(~m, big).amin(dim=-2)
        kmax = keys.masked_fill(~m, -big).amax(dim=-2)
        empty = ~valid.any(dim=-1)[:, None, None]  # an all-padding block: neutral summary
        kmin, kmax = kmin.masked_fill(empty, 0), kmax.masked_fill(empty, 0)
        return torch.stack([kmin, kmax], dim=-2)  # [b, h, 2, d]

    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        kmin, kmax = summaries[..., 0, :], summaries[..., 1, :]  # [b, h, n, d]
        q = queries[:, :, :, None, :]  # [b, h, nq, 1, d]
        ub = torch.maximum(q * kmin[:, :, None], q * kmax[:, :, None])
        return ub.sum(dim=-1)  # [b, h, nq, n]
