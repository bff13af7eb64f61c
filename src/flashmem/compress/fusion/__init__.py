"""Fusion rules, one per file; `make_rule` picks one by its config name."""

from __future__ import annotations

from flashmem.compress.fusion.attention_mass import AttentionMassRule
from flashmem.compress.fusion.base import FusionContext, FusionRule
from flashmem.compress.fusion.key_norm import KeyNormRule
from flashmem.compress.fusion.mean import MeanRule

RULES: dict[str, type[FusionRule]] = {
    r.name: r for r in (AttentionMassRule, KeyNormRule, MeanRule)
}


def make_rule(name: str) -> FusionRule:
    return RULES[name]()


__all__ = ["FusionContext", "FusionRule", "make_rule", "RULES"]
