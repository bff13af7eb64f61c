"""Fuse consecutive tokens into single K/V entries (CSA: a few tokens, HCA: a block).

Weights are a softmax of the rule's log-importance inside each chunk, padding
excluded. Keys are pooled in pre-RoPE space and re-rotated at the weighted mean
position of the chunk when a rotator is given (`fusion_rope: rerotate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmem.rope import RopeRotator


@dataclass
class FusedEntries:
    keys: torch.Tensor  # [batch, kv_heads, entries, head_dim]
    values: torch.Tensor  # [batch, kv_heads, entries, head_dim]
    counts: torch.Tensor  # [batch, entries]: valid tokens each entry stands for


def fuse_chunks(
    keys: torch.Tensor,
    values: torch.Tensor,
    log_importance: torch.Tensor,
    valid: torch.Tensor,
    positions: torch.Tensor,
    chunk: int,
    rotator: RopeRotator | None,
) -> FusedEntries:
    """keys/values: [b, h, T, d]; log_importance: [b, h, T]; valid: [b, T] bool;
    positions: [T] absolute positions. T must be a multiple of `chunk`."""
    b, h, T, d = keys.shape
    n = T // chunk
    logits = log_importance.float().masked_fill(~valid[:, None, :], float("-inf"))
    w = torch.softmax(logits.view(b, h, n, chunk), dim=-1).nan_to_num(0.0)  # all-pad chunk -> 0
    w = w.to(keys.dtype)
    if rotator is not None:
        pos = positions.to(keys.device)
        pre = rotator.unrotate(keys, pos)  # [b, h, T, d]
        pooled = (pre.view(b, h, n, chunk, d) * w[..., None]).sum(dim=-2)
        centre = (pos.view(n, chunk).to(w.dtype) * w).sum(dim=-1)  # [b, h, n]
        fused_k = rotator.rotate(pooled, centre)
    else:
        fused_k = (keys.view(b, h, n, chunk, d) * w[..., None]).sum(dim=-2)
    fused_v = (values.view(b, h, n, chunk, d) * w[..., None]).sum(dim=-2)
    counts = valid.view(b, n, chunk).sum(dim=-1)
    return FusedEntries(fused_k, fused_v, counts)
