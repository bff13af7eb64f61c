"""Fusion rules, one per file, registered in `flashmem.policies.FUSION_RULES`."""

from __future__ import annotations

from flashmem import policies
from flashmem.compress.fusion.base import FusionContext, FusionRule

RULES: dict[str, type[FusionRule]] = {name: policies.load(r.impl) for name, r in policies.FUSION_RULES.items()}


def make_rule(name: str) -> FusionRule:
    return policies.lookup(RULES, "fusion_rule", name)()


__all__ = ["FusionContext", "FusionRule", "make_rule", "RULES"]
