"""Top-k block selection per KV head from the index scores of this step's queries."""

from __future__ import annotations

import torch


def select_blocks(scores: torch.Tensor, block_valid: torch.Tensor, k: int, scaling: float) -> torch.Tensor:
    """scores: [b, h, nq, n] per query; block_valid: [b, n] bool -> indices [b, h, k].

    A GQA group and a prefill chunk pool their queries: each query's softmax over
    blocks says how it would spread its attention; the blocks with the most
    expected mass summed over queries win. Blocks holding only padding never win
    over real ones. Indices come back sorted, so gathered tokens keep their order.
    """
    n = scores.shape[-1]
    k = min(k, n)
    logits = (scores.float() * scaling).masked_fill(~block_valid[:, None, None, :], float("-inf"))
    mass = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=-2)  # [b, h, n]
    mass = mass.masked_fill(~block_valid[:, None, :], -1.0)
    idx = torch.topk(mass, k, dim=-1).indices
    return idx.sort(dim=-1).values
