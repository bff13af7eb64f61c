"""Block index scorers, one per file; `make_scorer` picks one by its config name."""

from __future__ import annotations

from flashmem.index.base import BlockScorer
from flashmem.index.gaussian import GaussianScorer
from flashmem.index.hca_key import HcaKeyScorer
from flashmem.index.mean_key import MeanKeyScorer
from flashmem.index.quest import QuestScorer

SCORERS: dict[str, type[BlockScorer]] = {s.name: s for s in (QuestScorer, MeanKeyScorer, HcaKeyScorer, GaussianScorer)}


def make_scorer(name: str) -> BlockScorer:
    return SCORERS[name]()


__all__ = ["BlockScorer", "SCORERS", "make_scorer"]
