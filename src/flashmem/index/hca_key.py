"""HCA-key scorer: rank blocks by q . (the block's HCA entry key).

The HCA entry is resident anyway, so this index costs no extra memory: the bytes
another scorer would spend on summaries buy more selected blocks instead.
"""

from __future__ import annotations

import torch

from flashmem.index.base import BlockScorer


class HcaKeyScorer(BlockScorer):
    name = "hca_key"
    vectors = 0
    uses_hca_entries = True  # reads the HCA entries: summaries: [b, h, n, 1, d] views of them

    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return keys.new_zeros(keys.shape[0], keys.shape[1], 0, keys.shape[-1])

    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        return torch.matmul(queries, summaries[..., 0, :].transpose(-1, -2))  # [b, h, nq, n]
