"""Block index scorers, one per file, registered in `flashmem.policies.SCORERS`."""

from __future__ import annotations

from flashmem import policies
from flashmem.index.base import BlockScorer, ScorerContext

SCORERS: dict[str, type[BlockScorer]] = {name: policies.load(s.impl) for name, s in policies.SCORERS.items()}


def make_scorer(name: str, ctx: ScorerContext | None = None) -> BlockScorer:
    """The scorer registered as `name`, built for one layer (`ctx`)."""
    return policies.lookup(SCORERS, "lsa_scorer", name)(ctx)


__all__ = ["BlockScorer", "SCORERS", "ScorerContext", "make_scorer"]
