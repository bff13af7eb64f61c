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
        # max(q_c * min_c, q_c * max_c) is q_c * max_c where q_c >= 0, else q_c * min_c:
        # two matmuls instead of a [b, h, nq, n, d] product (4 GB for a 512-query chunk at 1M tokens).
        q = queries.to(kmax.dtype)
        return q.clamp_min(0) @ kmax.transpose(-1, -2) + q.clamp_max(0) @ kmin.transpose(-1, -2)  # [b, h, nq, n]
