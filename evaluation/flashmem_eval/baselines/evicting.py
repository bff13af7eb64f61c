"""Shared machinery of the eviction baselines (StreamingLLM, SnapKV).

An :class:`EvictingLayer` is a `DynamicLayer` that may hold fewer K/V entries than
tokens seen: `get_seq_length()` returns the tokens seen (position ids derive from
it) and `get_mask_sizes()` reports the stored entries with an offset, so every
stored entry stays visible and the new tokens stay causal among themselves.
Optionally it keeps rolling: after each update only `sinks` + the last `window`
entries stay stored (StreamingLLM). Sliding-window layers (Gemma3's local layers)
are left as they are: budgets are over the global (managed) layers.

:func:`capture_last_queries` records, per layer, the last queries of a forward
pass (SnapKV's observation window) by wrapping the model's attention function
for the duration of a `with` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from flashmem.sizing.budget import full_kv_bytes  # noqa: F401 (re-exported for the harness)


class EvictingLayer(DynamicLayer):
    """A DynamicLayer whose stored entries may be a subset of the tokens seen."""

    is_sliding = False

    def __init__(self, sinks: int | None = None, window: int | None = None) -> None:
        super().__init__()
        self.cumulative_length = 0
        self.sinks = sinks
        self.window = window

    @classmethod
    def from_dynamic(cls, layer: DynamicLayer) -> EvictingLayer:
        new = cls()
        if layer.is_initialized and layer.keys is not None:
            new.lazy_initialization(layer.keys, layer.values)
            new.keys, new.values = layer.keys, layer.values
            new.cumulative_length = int(layer.keys.shape[-2])
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_k = torch.cat([self.keys, key_states], dim=-2)
        full_v = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = full_k, full_v
        if self.window is not None:
            self.roll(self.sinks or 0, self.window)
        return full_k, full_v

    def roll(self, sinks: int, window: int) -> None:
        """Keep the first `sinks` and the last `window` stored entries."""
        n = self.keys.shape[-2]
        if n <= sinks + window:
            return
        self.keys = torch.cat([self.keys[..., :sinks, :], self.keys[..., n - window :, :]], dim=-2)
        self.values = torch.cat([self.values[..., :sinks, :], self.values[..., n - window :, :]], dim=-2)

    def keep(self, index: torch.Tensor) -> None:
        """Keep stored entries `index` ([batch, kv_heads, k], per head) in that order."""
        idx = index.unsqueeze(-1).expand(*index.shape, self.keys.shape[-1])
        self.keys = self.keys.gather(2, idx)
        self.values = self.values.gather(2, idx.expand(*index.shape, self.values.shape[-1]))

    def stored(self) -> int:
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return 0
        return int(self.keys.shape[-2])

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.stored()
        return stored + query_length, self.cumulative_length - stored

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover - not used by the harness
        raise NotImplementedError("an evicting layer cannot be cropped")


def to_evicting(cache: DynamicCache) -> DynamicCache:
    """A new cache sharing `cache`'s tensors, its global layers turned into EvictingLayers.

    The tensors are shared, not copied: every update concatenates into new
    tensors, so the source cache stays valid.
    """
    import copy

    new = copy.copy(cache)
    new.layers = []
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            twin = copy.copy(layer)
        elif isinstance(layer, EvictingLayer):
            twin = copy.copy(layer)
        else:
            twin = EvictingLayer.from_dynamic(layer)
        new.layers.append(twin)
    return new


def new_cache(model: Any) -> DynamicCache:
    """An empty DynamicCache laid out for `model` (sliding layers where the config has them)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return DynamicCache(config=cfg)


def kv_bytes(cache: Any) -> dict[str, int]:
    """Bytes of K/V tensors held by a DynamicCache-like cache, split managed/sliding."""
    managed = sliding = 0
    for layer in getattr(cache, "layers", []):
        keys = getattr(layer, "keys", None)
        values = getattr(layer, "values", None)
        if keys is None or not isinstance(keys, torch.Tensor):
            continue
        b = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        if getattr(layer, "is_sliding", False):
            sliding += b
        else:
            managed += b
    return {"managed_bytes": managed, "sliding_bytes": sliding, "total_bytes": managed + sliding}


_CAPTURED: dict[int, dict[str, Any]] | None = None
_WINDOW = 0


def _capturing(original: Any):
    def fn(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ):
        if _CAPTURED is not None:
            idx = getattr(module, "layer_idx", None)
            _CAPTURED[idx] = {
                "query": query[:, :, -_WINDOW:, :].detach(),
                "scaling": kwargs.get("scaling", getattr(module, "scaling", None)),
                "sliding": kwargs.get("sliding_window", getattr(module, "sliding_window", None)),
            }
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return fn


@contextlib.contextmanager
def capture_last_queries(model: Any, window: int) -> Iterator[dict[int, dict[str, Any]]]:
    """Record each layer's last `window` queries (post-RoPE) during the block."""
    global _CAPTURED, _WINDOW
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation or "sdpa"
    had_local = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
    prev_local = ALL_ATTENTION_FUNCTIONS._local_mapping.get(impl)
    original = ALL_ATTENTION_FUNCTIONS[impl] if impl in ALL_ATTENTION_FUNCTIONS else sdpa_attention_forward
    ALL_ATTENTION_FUNCTIONS[impl] = _capturing(original)
    captured: dict[int, dict[str, Any]] = {}
    _CAPTURED, _WINDOW = captured, window
    try:
        yield captured
    finally:
        _CAPTURED = None
        if had_local:
            ALL_ATTENTION_FUNCTIONS._local_mapping[impl] = prev_local
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]
