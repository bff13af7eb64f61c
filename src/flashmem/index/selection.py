"""Top-k block selection per KV head from the index scores of this step's queries."""

from __future__ import annotations

from collections.abc import Callable

import torch

# A chunk of queries is scored against every page at most this many bytes of fp32 scores
# at a time (`blocked_index_mass`). Whole, a prompt chunk's scores grow with the chunk times
# the context: Llama-3.1-8B's geometry at 128K in 4,096-token chunks held 4.3 GB of scores
# per temporary, about 15 GB of transients on an H200 (results/gpu_check_h200.json). On a CPU
# the scores are the process's RAM, beside a budget of tens of MB: there at most
# SCORE_BLOCK_BYTES_CPU (cache/scratch.py's CPU_TRANSIENT_BYTES, as a prompt chunk's mask).
SCORE_BLOCK_BYTES = 64 << 20
SCORE_BLOCK_BYTES_CPU = 8 << 20


def select_blocks(
    scores: torch.Tensor,
    block_valid: torch.Tensor,
    k: int,
    scaling: float,
    follow: int = 0,
    pool: str = "mean",
    share_heads: bool = False,
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

    `share_heads`: the KV heads' masses are summed and every head gets the same
    pages, so a step needs the blocks of k pages, not of up to h * k.
    """
    return top_pages(index_mass(scores, block_valid, scaling, pool, share_heads), block_valid[:, None, :], k, follow)


def index_mass(
    scores: torch.Tensor, block_valid: torch.Tensor, scaling: float, pool: str = "mean", share_heads: bool = False
) -> torch.Tensor:
    """The pooled expected attention mass per unit [b, h, n] of scores [b, h, nq, n]: each
    query's softmax over the valid units (block_valid [b, n]), pooled (see pool_mass)."""
    # in place where it can be: a prompt chunk's scores are a block of up to SCORE_BLOCK_BYTES, and
    # each out-of-place step held one more copy (three beside the scores before, two now)
    logits = scores.float() * scaling
    logits.masked_fill_(~block_valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    del logits
    return pool_mass(probs.nan_to_num_(0.0), pool, share_heads)


def blocked_index_mass(
    score: Callable[[torch.Tensor], torch.Tensor],
    queries: torch.Tensor,
    block_valid: torch.Tensor,
    scaling: float,
    pool: str = "mean",
    share_heads: bool = False,
    max_bytes: int | None = None,
) -> torch.Tensor:
    """index_mass(score(queries), ...) with the queries [b, h, nq, d] scored a block at a time,
    so that at most `max_bytes` (None: SCORE_BLOCK_BYTES, on a CPU SCORE_BLOCK_BYTES_CPU) of
    scores [b, h, rows, n] are held (block_valid [b, n]); see `pooled_in_blocks`. A decode
    step's queries are one block: index_mass as before."""
    b, h, nq, _ = queries.shape
    rows = score_rows(b, h, block_valid.shape[-1], queries.device, max_bytes)

    def mass_of(q: torch.Tensor, share: bool) -> torch.Tensor:
        return index_mass(score(q), block_valid, scaling, pool, share)

    return pooled_in_blocks(mass_of, queries, rows, pool, share_heads)


def pooled_in_blocks(
    mass_of: Callable[[torch.Tensor, bool], torch.Tensor],
    queries: torch.Tensor,
    rows: int,
    pool: str = "mean",
    share_heads: bool = False,
) -> torch.Tensor:
    """A pooled mass [b, h, n] of queries [b, h, nq, ...], `rows` queries at a time:
    mass_of(query block, share_heads) pools one block's. The blocks' masses are weighed by
    their share of the queries (mean) or maxed (max), and the heads shared at the end, which
    is the pooled mass of all the queries at once; one block when rows >= nq."""
    nq = queries.shape[2]
    if rows >= nq:
        return mass_of(queries, share_heads)
    mass: torch.Tensor | None = None
    for i0 in range(0, nq, rows):
        part = mass_of(queries[:, :, i0 : i0 + rows], False)  # [b, h, n]
        if pool == "max":
            mass = part if mass is None else torch.maximum(mass, part)
        else:
            part.mul_(min(rows, nq - i0) / nq)
            mass = part if mass is None else mass.add_(part)
    assert mass is not None
    if share_heads:
        mass = mass.mean(dim=1, keepdim=True).expand_as(mass)
    return mass


def score_rows(b: int, h: int, n: int, device: torch.device, max_bytes: int | None = None) -> int:
    """Query rows of fp32 scores [b, h, rows, n] within `max_bytes` (None: SCORE_BLOCK_BYTES,
    on a CPU SCORE_BLOCK_BYTES_CPU); at least one."""
    cap = SCORE_BLOCK_BYTES if max_bytes is None else max_bytes
    if max_bytes is None and device.type == "cpu":
        cap = min(cap, SCORE_BLOCK_BYTES_CPU)
    return max(1, cap // max(1, b * h * n * 4))


def pool_mass(probs: torch.Tensor, pool: str = "mean", share_heads: bool = False) -> torch.Tensor:
    """Per-query page distributions [b, h, nq, n] -> one mass per page [b, h, n]:
    mean (expected mass) or max over the queries, then summed over KV heads if shared."""
    mass = probs.amax(dim=-2) if pool == "max" else probs.mean(dim=-2)
    if share_heads:
        mass = mass.mean(dim=1, keepdim=True).expand_as(mass)
    return mass


def top_pages(mass: torch.Tensor, allowed: torch.Tensor, k: int, follow: int = 0) -> torch.Tensor:
    """The k pages of most mass [b, h, n] among `allowed` ([b, h or 1, n] bool), after
    each lends to its `follow` successors (see select_blocks) -> sorted ids [b, h, k]."""
    return ranked_pages(mass, allowed, k, follow).sort(dim=-1).values


def ranked_pages(mass: torch.Tensor, allowed: torch.Tensor, k: int, follow: int = 0) -> torch.Tensor:
    """top_pages in rank order: ids [b, h, k], the page of most mass first (a step that
    attends the first k' <= k of them attends top_pages(..., k'), ties aside)."""
    n = mass.shape[-1]
    k = min(k, n)
    own = mass
    for j in range(1, min(follow, n - 1) + 1):
        lent = torch.zeros_like(own)
        lent[..., j:] = own[..., :-j] * (1.0 - 1e-3 * j)
        mass = torch.maximum(mass, lent)
    mass = mass.masked_fill(~allowed, -1.0)
    return torch.topk(mass, k, dim=-1).indices


def feedback_pages(
    idx: torch.Tensor, mass: torch.Tensor, vecs: torch.Tensor, allowed: torch.Tensor, share: int, seeds: int = 2
) -> torch.Tensor:
    """A second hop (pseudo-relevance feedback): `share` of the k selected pages idx [b, h, k]
    (sorted) go to pages that look like the best selected ones rather than like the query.

    The k - share picks of most `mass` [b, h, n] stay; the `seeds` picks of most mass are the
    feedback queries; the `share` pages among `allowed` ([b, h or 1, n] bool) not kept whose
    summary vecs [b, h, n, d] (e.g. mean values: no RoPE, so the same text at another position
    looks the same) have the highest cosine to any seed, after centring the summaries over the
    allowed pages, fill the rest -> sorted ids [b, h, k]. Notes that repeat a pattern
    ("Inventory note: a crate of X") look alike, so the one the query finds brings the others.
    """
    b, h, k = idx.shape
    n = mass.shape[-1]
    share = min(share, k)
    if share <= 0 or k >= n:
        return idx
    picked = mass.gather(-1, idx)  # [b, h, k]
    order = idx.gather(-1, picked.argsort(dim=-1, descending=True, stable=True))
    keep = order[..., : k - share]
    allow = allowed.expand(b, h, n)
    w = allow.to(vecs.dtype)[..., None]
    centre = (vecs * w).sum(-2, keepdim=True) / w.sum(-2, keepdim=True).clamp_min(1.0)
    unit = torch.nn.functional.normalize((vecs - centre).float(), dim=-1)  # [b, h, n, d]
    anchor = unit.gather(-2, order[..., : max(1, min(seeds, k)), None].expand(-1, -1, -1, unit.shape[-1]))
    sim = torch.matmul(unit, anchor.transpose(-1, -2)).amax(-1)  # [b, h, n]
    sim = sim.masked_fill(~allow, -3.0).scatter(-1, keep, -2.0)
    extra = torch.topk(sim, share, dim=-1).indices
    return torch.cat([keep, extra], dim=-1).sort(dim=-1).values
