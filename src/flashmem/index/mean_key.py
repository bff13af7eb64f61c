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

    def score_coded(
        self, queries: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scaling: float | None = None
    ) -> torch.Tensor:
        # q . (codes * s) = (q . codes) * s: the scale is applied to the n scores, not to the
        # n x d decoded keys. The codes convert exactly to the queries' dtype (|c| <= 127), so
        # the one copy a step makes of them is in that dtype (bf16 on an accelerator: half of
        # fp32's bytes written and read back); the scales multiply in fp32.
        dots = torch.matmul(queries, codes[..., 0, :].to(queries.dtype).transpose(-1, -2))  # [b, h, nq, n]
        return dots.float().mul_(scales[..., 0].to(torch.float32)[:, :, None, :]).to(queries.dtype)
