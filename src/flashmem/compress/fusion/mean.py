"""Uniform weights: plain mean pooling, the baseline the data-driven rules must beat."""

from __future__ import annotations

import torch

from flashmem.compress.fusion.base import FusionContext, FusionRule


class MeanRule(FusionRule):
    name = "mean"

    def log_importance(self, keys: torch.Tensor, ctx: FusionContext) -> torch.Tensor:
        return torch.zeros(keys.shape[:-1], dtype=keys.dtype, device=keys.device)
