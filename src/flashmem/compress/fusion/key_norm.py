"""Weights from key norms: a query-independent proxy of how salient a token is."""

from __future__ import annotations

import torch

from flashmem.compress.fusion.base import FusionContext, FusionRule


class KeyNormRule(FusionRule):
    name = "key_norm"

    def log_importance(self, keys: torch.Tensor, ctx: FusionContext) -> torch.Tensor:
        return keys.float().norm(dim=-1).to(keys.dtype)  # [b, h, T]
