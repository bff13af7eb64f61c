"""Thin adapter from the benchmark harness to the FlashMemory cache.

The budget -> config mapping lives in the library (`flashmem.sizing.budget`,
`FlashMemoryConfig.for_budget`); this module re-exports it for the harness.
"""

from __future__ import annotations

from typing import Any

from flashmem.config import FlashMemoryConfig
from flashmem.errors import FlashMemError
from flashmem.recipe import RECIPE, SHAPE
from flashmem.sizing.budget import budget_config, predicted_ratio
from flashmem_eval.variants import SHAPES, VARIANTS

__all__ = ["RECIPE", "SHAPE", "SHAPES", "VARIANTS", "attach", "budget_config", "predicted_ratio"]


def attach(model: Any, cfg: FlashMemoryConfig) -> Any:
    import flashmem

    try:
        fn = flashmem.attach
    except (ImportError, AttributeError) as exc:
        raise FlashMemError(f"flashmem.attach is not available in this checkout ({exc})") from None
    return fn(model, cfg)
