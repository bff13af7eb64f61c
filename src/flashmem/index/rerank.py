"""Second stage of selection: candidate pages re-ranked by their exact keys.

The index ranks pages by a summary (a page's int8 mean key), which blurs a page
whose mass sits on one or two tokens (the digits of a key, a name): on the 2K
misses it ranked the needle's page 4th to 30th (docs/measurements.md, "What the
misses at 2K are"). With `lsa_rerank: r` the index picks r * k candidates, their
exact keys are read from the cold tier, and the k pages with the most exact
attention mass win (Quest's and ShadowKV's "over-select, then verify" idea).
"""

from __future__ import annotations

import torch

from flashmem.index.selection import pool_mass


def exact_page_mass(
    qg: torch.Tensor,
    cand_k: torch.Tensor,
    cand_valid: torch.Tensor,
    scaling: float,
    pool: str = "mean",
    share_heads: bool = False,
) -> torch.Tensor:
    """Each query's softmax over the candidates' tokens, summed per page and pooled
    over queries (as select_blocks pools the index's page distributions).

    qg: [b, h, nq, d] queries grouped by KV head; cand_k: [b, h, c, P, d] candidate
    pages' keys; cand_valid: [b, h, c, P] -> mass [b, h, c].
    """
    b, h, c, P, d = cand_k.shape
    logits = torch.matmul(qg, cand_k.reshape(b, h, c * P, d).transpose(-1, -2)).float() * scaling
    logits = logits.masked_fill(~cand_valid.reshape(b, h, 1, c * P), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).view(b, h, -1, c, P).sum(-1)  # [b, h, nq, c]
    return pool_mass(probs, pool, share_heads)
