"""Fusion rules: how much each token of a chunk weighs in its fused entry.

The pretrained model has no trained compressor, so the weights come from the
data. A rule returns per-token log-importance; `flashmem.compress.chunk_fusion`
turns it into softmax weights inside each chunk (CSA: `csa_chunk_size` tokens,
HCA: the whole block), padding excluded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class FusionContext:
    """What a rule may look at when a block is sealed."""

    recent_queries: torch.Tensor | None  # [batch, kv_heads, n_queries, head_dim], post-RoPE
    scaling: float  # the model's attention scale (1/sqrt(head_dim) usually)


class FusionRule(ABC):
    name: str

    @abstractmethod
    def log_importance(self, keys: torch.Tensor, ctx: FusionContext) -> torch.Tensor:
        """keys: [batch, kv_heads, tokens, head_dim] -> [batch, kv_heads, tokens]."""
