"""FlashMemoryCache: a transformers `Cache` whose managed layers are FlashLayers.

Layer kinds, decided once from the model config:
- sliding-window layers (Gemma3's local layers) keep transformers' own bounded
  `DynamicSlidingWindowLayer`, untouched;
- `keep_full_layers` keep a plain `DynamicLayer`;
- every other attention layer is a `FlashLayer`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from flashmem.cache.flash_layer import FlashLayer
from flashmem.cache.rope import RopeRotator
from flashmem.compress.fusion import make_rule
from flashmem.config import FlashMemoryConfig
from flashmem.index import make_scorer
from flashmem.store.base import ColdStore
from flashmem.store.memory import MemoryStore

TIERS = ("sinks", "window", "open_block", "csa_entries", "hca_entries", "index", "working_set", "query_buffer")


class FlashMemoryCache(Cache):
    """The FlashMemory tiered KV cache. Build it with `flashmem.attach(model, cfg)`."""

    def __init__(
        self,
        model_config: PretrainedConfig,
        cfg: FlashMemoryConfig,
        rotators: dict[str | None, RopeRotator | None] | None = None,
        store: ColdStore | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        text_cfg = model_config.get_text_config(decoder=True)
        n_layers = text_cfg.num_hidden_layers
        full = cfg.resolve_full_layers(n_layers)
        layer_types = getattr(text_cfg, "layer_types", None) or ["full_attention"] * n_layers
        self.cfg = cfg
        self.store = store if store is not None else _default_store(cfg, dtype)
        self._finalizer = weakref.finalize(self, self.store.close)
        rotators = rotators or {}
        layers: list[Any] = []
        for i, kind in enumerate(layer_types):
            if kind in ("sliding_attention", "chunked_attention") and getattr(text_cfg, "sliding_window", None):
                layers.append(DynamicSlidingWindowLayer(sliding_window=text_cfg.sliding_window))
            elif i in full:
                layers.append(DynamicLayer())
            else:
                layers.append(
                    FlashLayer(
                        i,
                        cfg,
                        self.store,
                        make_scorer(cfg.lsa_scorer),
                        make_rule(cfg.fusion_rule),
                        rotators.get(kind),
                    )
                )
        super().__init__(layers=layers)

    # ------------------------------------------------------------ reporting
    @property
    def flash_layers(self) -> list[FlashLayer]:
        return [layer for layer in self.layers if isinstance(layer, FlashLayer)]

    def memory_report(self) -> dict[str, Any]:
        """Measured bytes of real tensors per tier, summed over layers, plus tokens seen.

        `device_resident_bytes` counts every tensor the cache keeps on the device:
        the FlashMemory tiers, the working set of selected blocks, plain full
        layers and sliding-window layers. `cold_bytes` is what the cold tier holds.
        """
        tiers = dict.fromkeys(TIERS, 0)
        for layer in self.flash_layers:
            if layer.is_initialized:
                for name, nbytes in layer.resident_bytes().items():
                    tiers[name] += nbytes
        full = sliding = 0
        for layer in self.layers:
            if isinstance(layer, FlashLayer) or not layer.is_initialized:
                continue
            nbytes = _nbytes(layer.keys) + _nbytes(layer.values)
            if isinstance(layer, DynamicSlidingWindowLayer):
                sliding += nbytes
            else:
                full += nbytes
        managed = sum(tiers.values())
        return {
            "tokens_seen": self.get_seq_length(),
            "tiers": tiers,
            "managed_resident_bytes": managed,
            "full_layer_bytes": full,
            "sliding_layer_bytes": sliding,
            "device_resident_bytes": managed + full + sliding,
            "peak_managed_resident_bytes": sum(layer.peak_resident_bytes for layer in self.flash_layers),
            "cold_bytes": self.store.nbytes(),
            "sealed_blocks": sum(layer.num_sealed for layer in self.flash_layers if layer.is_initialized),
        }

    def stats(self) -> dict[str, Any]:
        """Cold-tier counters (reads, writes, bytes) as the store reports them."""
        s = self.store.stats
        return {"puts": s.puts, "gets": s.gets, "bytes_written": s.bytes_written, "bytes_read": s.bytes_read, **s.extra}

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the cold tier (its files too, unless the config asked to persist)."""
        self._finalizer()

    def __enter__(self) -> "FlashMemoryCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default_store(cfg: FlashMemoryConfig, dtype: torch.dtype) -> ColdStore:
    if cfg.cold_store == "memory" and cfg.cold_codec == "exact":
        return MemoryStore()
    from flashmem.store import open_store

    return open_store(cfg, dtype=dtype)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
