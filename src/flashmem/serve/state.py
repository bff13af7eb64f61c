"""Export and import a FlashMemoryCache's state at a prefix boundary, incrementally.

A prefix record holds what the cache gained between two boundaries of the prompt:
per managed layer the K/V of every new position (in token order) and the small
append-only parts (index pages, validity, summaries; `cache/layer_state.py`), per
plain layer its new K/V, per sliding layer its window. Replaying records 1..j into a
fresh cache rebuilds the state the cache had after boundary j, so continuing from
there computes what a fresh prefill computes (exactly with the `exact` record codec;
within the codec's error with `int8`, `flashmem.serve.prefix`).

K/V pairs are named `<layer>.<part>.k` / `.v` ([b, h, n, d] each): the prefix store
codes every such pair with the cold tier's codec and checksums (`prefix.encode_record`);
the other tensors are stored as they are.

A FlashLayer exports and loads its own part (`FlashLayer.export_state` /
`load_state`, cache/layer_state.py); this module prefixes its tensors with the
layer index and handles transformers' plain layers. tests/test_serve_prefix.py
round-trips it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from flashmem.cache.flash_cache import FlashMemoryCache
from flashmem.cache.flash_layer import FlashLayer
from flashmem.cache.layer_state import LayerMark


@dataclass
class Mark:
    """Where each layer's append-only parts ended at the previous boundary."""

    flash: list[LayerMark] = field(default_factory=list)
    plain: list[int] = field(default_factory=list)


def mark(cache: FlashMemoryCache) -> Mark:
    """The current ends of every layer's append-only parts (the next delta starts here)."""
    m = Mark()
    for layer in cache.layers:
        init = getattr(layer, "is_initialized", False)
        if isinstance(layer, FlashLayer):
            m.flash.append(layer.state_mark())
            m.plain.append(0)
        else:
            m.flash.append(LayerMark())
            keys: Any = getattr(layer, "keys", None)
            m.plain.append(int(keys.shape[-2]) if init and keys is not None and keys.dim() == 4 else 0)
    return m


def export_delta(cache: FlashMemoryCache, since: Mark) -> dict[str, torch.Tensor]:
    """Tensors of what the cache gained since `since`, plus its tail now (CPU, contiguous)."""
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            out[name] = t.detach().to("cpu").contiguous()

    for i, layer in enumerate(cache.layers):
        p = f"{i}."
        if not getattr(layer, "is_initialized", False):
            continue
        if isinstance(layer, FlashLayer):
            for name, t in layer.export_state(since.flash[i]).items():
                put(p + name, t)
        elif isinstance(layer, DynamicSlidingWindowLayer):
            put(p + "win.k", layer.keys)
            put(p + "win.v", layer.values)
            put(p + "meta", torch.tensor([layer.cumulative_length], dtype=torch.long))
        elif isinstance(layer, DynamicLayer):
            assert layer.keys is not None and layer.values is not None  # initialized
            put(p + "kv.k", layer.keys[:, :, since.plain[i] :])
            put(p + "kv.v", layer.values[:, :, since.plain[i] :])
    return out


def import_records(cache: FlashMemoryCache, records: list[dict[str, torch.Tensor]]) -> None:
    """Rebuild, in a fresh (empty) cache, the state after the last of `records`
    (the records of boundaries 1..j, in order)."""
    if not records:
        return
    last = records[-1]
    for i, layer in enumerate(cache.layers):
        p = f"{i}."
        if p + "meta" not in last and p + "kv.k" not in last:
            continue  # the layer had not started when the record was written
        if isinstance(layer, FlashLayer):
            n = len(p)
            layer.load_state([{k[n:]: t for k, t in r.items() if k.startswith(p)} for r in records])
        elif isinstance(layer, DynamicSlidingWindowLayer):
            k, v = last[p + "win.k"], last[p + "win.v"]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k.clone(), v.clone()
            layer.cumulative_length = int(last[p + "meta"][0])
        elif isinstance(layer, DynamicLayer):
            ks = [r[p + "kv.k"] for r in records if p + "kv.k" in r]
            vs = [r[p + "kv.v"] for r in records if p + "kv.v" in r]
            layer.lazy_initialization(ks[0], vs[0])
            layer.keys, layer.values = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)


def record_bytes(record: dict[str, Any]) -> int:
    return sum(int(t.nbytes) for t in record.values())
