"""Learned per-token scorer: the seed's LSA index, a linear dual encoder.

Like `lowrank`, each sealed token keeps r numbers resident, but queries and keys
have their own encoders (`query_proj`, `key_proj`, [r, d] per KV head),
fitted by `flashmem calibrate`: initialised in closed form for the least
expected error of q.k, then trained so that the indexer's distribution over
history pages matches the model's dense attention mass (KL), as DeepSeek-V3.2
warms up its lightning indexer. Page score: log-sum-exp over the page's tokens.
"""

from __future__ import annotations

from flashmem.index.lowrank import LowRankScorer


class LearnedScorer(LowRankScorer):
    name = "learned"
    query_key = "query_proj"
    key_key = "key_proj"
