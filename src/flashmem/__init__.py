"""flashmem: the FlashMemory KV cache for Hugging Face transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flashmem.config import FlashMemoryConfig
from flashmem.errors import ConfigError, FlashMemError
from flashmem.sizing import budget as _budget  # noqa: F401  (registers the solver FlashMemoryConfig.for_budget calls)

__version__ = "0.1.0"

__all__ = [
    "FlashMemoryConfig",
    "ConfigError",
    "FlashMemError",
    "attach",
    "calibrate",
    "estimate",
    "load_model",
    "prefill",
    "register",
]

# Heavy modules (torch models, transformers) load on first use.
_LAZY = {
    "attach": ("flashmem.cache.attach", "attach"),
    "FlashMemoryCache": ("flashmem.cache.flash_cache", "FlashMemoryCache"),
    "estimate": ("flashmem.sizing.calculator", "estimate"),
    "calibrate": ("flashmem.calibration", "calibrate"),
    "load_model": ("flashmem.models.loading", "load_model"),
    "prefill": ("flashmem.cache.prefill", "prefill"),
    "register": ("flashmem.cache.attach", "register"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'flashmem' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from flashmem.cache.attach import attach
    from flashmem.cache.prefill import prefill
    from flashmem.models.loading import load_model
    from flashmem.sizing.calculator import estimate
