"""Top-k block selection per KV head from the index scores of this step's queries."""

from __future__ import annotations

import torch


def select_blocks(
    scores: torch.Tensor,
    block_valid: torch.Tensor,
    k: int,
    scaling: float,
    follow: int = 0,
    pool: str = "mean",
) -> torch.Tensor:
    """scores: [b, h, nq, n] per query; block_valid: [b, n] bool -> indices [b, h, k].

    A GQA group and a prefill chunk pool their queries: each query's softmax over
    blocks says how it would spread its attention; the blocks with the most
    expected mass summed over queries win. Blocks holding only padding never win
    over real ones. Indices come back sorted, so gathered tokens keep their order.

    `follow` > 0: each unit also lends its mass (a hair less, so it ranks right
    behind) to the `follow` units after it, so a winner brings the text that
    follows it within the same k. A question's query matches the cue ("the code
    for X is"); the answer sits in the next tokens, often across a page border.
    """
    n = scores.shape[-1]
    k = min(k, n)
    logits = (scores.float() * scaling).masked_fill(~block_valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    mass = probs.amax(dim=-2) if pool == "max" else probs.mean(dim=-2)  # [b, h, n]
    own = mass
    for j in range(1, min(follow, n - 1) + 1):
        lent = torch.zeros_like(own)
        lent[..., j:] = own[..., :-j] * (1.0 - 1e-3 * j)
        mass = torch.maximum(mass, lent)
    mass = mass.masked_fill(~block_valid[:, None, :], -1.0)
    idx = torch.topk(mass, k, dim=-1).indices
    return idx.sort(dim=-1).values
