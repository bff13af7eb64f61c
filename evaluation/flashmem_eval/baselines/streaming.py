"""StreamingLLM baseline (Xiao et al., 2023): attention sinks + a recent window.

After the prompt is prefilled with full attention, each global layer keeps the
first `sinks` entries and the last `window` entries; from then on the layer
keeps rolling (every update drops what falls out of the window), so its
device-resident size stays `sinks + window` entries.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache

from flashmem_eval.baselines.evicting import EvictingLayer, new_cache, to_evicting

DEFAULT_SINKS = 4


def streaming_sizes(budget: float, tokens: int, sinks: int = DEFAULT_SINKS) -> tuple[int, int]:
    """(sinks, window) holding `budget` of `tokens` entries."""
    keep = max(1, round(budget * tokens))
    sinks = min(sinks, max(0, keep // 2))
    return sinks, max(1, keep - sinks)


class StreamingCache(DynamicCache):
    """A DynamicCache whose global layers keep sinks + a rolling window from the start."""

    def __init__(self, model: Any, sinks: int, window: int) -> None:
        base = new_cache(model)
        layers = [
            layer if getattr(layer, "is_sliding", False) else EvictingLayer(sinks=sinks, window=window)
            for layer in base.layers
        ]
        super().__init__()
        self.layers = layers
        self.sinks, self.window = sinks, window


def streaming_compress(cache: DynamicCache, sinks: int, window: int) -> DynamicCache:
    """A rolling sinks+window cache made from a prefilled (full) cache; source untouched."""
    out = to_evicting(cache)
    for layer in out.layers:
        if isinstance(layer, EvictingLayer):
            layer.sinks, layer.window = sinks, window
            if layer.stored():
                layer.roll(sinks, window)
    return out
