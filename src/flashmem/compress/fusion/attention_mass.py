"""Weights from the attention mass that the most recent queries give each token."""

from __future__ import annotations

import torch

from flashmem.compress.fusion.base import FusionContext, FusionRule


class AttentionMassRule(FusionRule):
    """log of mean_q softmax_block(q.k * scale): tokens the model currently reads weigh more."""

    name = "attention_mass"

    def log_importance(self, keys: torch.Tensor, ctx: FusionContext) -> torch.Tensor:
        q = ctx.recent_queries
        if q is None or q.shape[-2] == 0:
            return torch.zeros(keys.shape[:-1], dtype=keys.dtype, device=keys.device)
        logits = torch.matmul(q.to(keys.dtype), keys.transpose(-1, -2)) * ctx.scaling  # [b, h, nq, T]
        mass = torch.softmax(logits.float(), dim=-1).mean(dim=-2)  # [b, h, T]
        return mass.clamp_min(1e-30).log().to(keys.dtype)
