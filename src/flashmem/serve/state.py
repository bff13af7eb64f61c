"""Export and import a FlashMemoryCache's state at a prefix boundary, incrementally.

A prefix record holds what the cache gained between two boundaries of the
prompt (append-only parts: sealed blocks' exact K/V from the cold tier, their
HCA entries and index pages, the validity of the new positions, the plain
layers' new K/V) plus the bounded "tail" at the boundary (sinks, open block,
window, recent queries, the near band's CSA entries, the sealed values' sum,
sliding layers). Replaying
records 1..j into a fresh cache rebuilds exactly the state the cache had after
boundary j, so continuing from there computes what a fresh prefill computes.

This module reads FlashLayer's attributes directly (so flash_layer.py stays
untouched); tests/test_serve_prefix.py round-trips it, so a change of the
layer's state that this file does not follow fails there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from flashmem.cache.flash_cache import FlashMemoryCache
from flashmem.cache.flash_layer import FlashLayer


@dataclass
class Mark:
    """Where each layer's append-only parts ended at the previous boundary."""

    sealed: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    valid: list[int] = field(default_factory=list)
    plain: list[int] = field(default_factory=list)


def mark(cache: FlashMemoryCache) -> Mark:
    """The current ends of every layer's append-only parts (the next delta starts here)."""
    m = Mark()
    for layer in cache.layers:
        init = getattr(layer, "is_initialized", False)
        if isinstance(layer, FlashLayer):
            m.sealed.append(layer.sealed if init else 0)
            m.pages.append(layer.index.count if init else 0)
            m.valid.append(layer.valid.shape[-1] if init else 0)
            m.plain.append(0)
        else:
            m.sealed.append(0)
            m.pages.append(0)
            m.valid.append(0)
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
            s0, s1 = since.sealed[i], layer.sealed
            for j in range(s0, s1):
                k, v = layer.store.get((layer.layer_idx, j), "cpu")
                put(f"{p}block.{j}.k", k)
                put(f"{p}block.{j}.v", v)
            if layer.hca_k.shape[-2]:
                put(p + "hca_k", layer.hca_k[:, :, s0:s1])
                put(p + "hca_v", layer.hca_v[:, :, s0:s1])
                put(p + "hca_cnt", layer.hca_cnt[:, s0:s1])
            put(p + "index_codes", layer.index.codes[:, :, since.pages[i] :])
            if layer.index.scales is not None:
                put(p + "index_scales", layer.index.scales[:, :, since.pages[i] :])
            put(p + "valid", layer.valid[:, since.valid[i] :])
            for name in ("sink_k", "sink_v", "win_k", "win_v", "open_k", "open_v", "recent_q", "v_sum"):
                put(p + name, getattr(layer, name))
            for bid, ck, cv, cc in layer.csa_blocks:
                put(f"{p}csa.{bid}.k", ck)
                put(f"{p}csa.{bid}.v", cv)
                put(f"{p}csa.{bid}.cnt", cc)
            put(p + "meta", torch.tensor([layer.tokens_seen, layer.sealed], dtype=torch.long))
            put(p + "scaling", torch.tensor([layer.scaling], dtype=torch.float64))
        elif isinstance(layer, DynamicSlidingWindowLayer):
            put(p + "keys", layer.keys)
            put(p + "values", layer.values)
            put(p + "meta", torch.tensor([layer.cumulative_length], dtype=torch.long))
        elif isinstance(layer, DynamicLayer):
            assert layer.keys is not None and layer.values is not None  # initialized
            put(p + "keys_delta", layer.keys[:, :, since.plain[i] :])
            put(p + "values_delta", layer.values[:, :, since.plain[i] :])
    return out


def import_records(cache: FlashMemoryCache, records: list[dict[str, torch.Tensor]]) -> None:
    """Rebuild, in a fresh (empty) cache, the state after the last of `records`
    (the records of boundaries 1..j, in order)."""
    if not records:
        return
    last = records[-1]
    for i, layer in enumerate(cache.layers):
        p = f"{i}."
        if p + "meta" not in last and p + "keys_delta" not in last:
            continue  # the layer had not started when the record was written
        if isinstance(layer, FlashLayer):
            _import_flash(layer, p, records)
        elif isinstance(layer, DynamicSlidingWindowLayer):
            k, v = last[p + "keys"], last[p + "values"]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k.clone(), v.clone()
            layer.cumulative_length = int(last[p + "meta"][0])
        elif isinstance(layer, DynamicLayer):
            ks = [r[p + "keys_delta"] for r in records if p + "keys_delta" in r]
            vs = [r[p + "values_delta"] for r in records if p + "values_delta" in r]
            layer.lazy_initialization(ks[0], vs[0])
            layer.keys, layer.values = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)


def _import_flash(layer: FlashLayer, p: str, records: list[dict[str, torch.Tensor]]) -> None:
    last = records[-1]
    sink = last[p + "sink_k"]
    layer.lazy_initialization(sink, last[p + "sink_v"])
    dev = layer.device
    for r in records:
        for name, t in r.items():
            if name.startswith(p + "block.") and name.endswith(".k"):
                j = int(name[len(p) :].split(".")[1])
                layer.store.put((layer.layer_idx, j), t.to(dev), r[name[:-2] + ".v"].to(dev))

    def cat(name: str, dim: int, into: torch.Tensor) -> torch.Tensor:
        parts = [r[p + name].to(dev) for r in records if p + name in r]
        return torch.cat([into, *parts], dim=dim) if parts else into

    layer.hca_k = cat("hca_k", -2, layer.hca_k)
    layer.hca_v = cat("hca_v", -2, layer.hca_v)
    layer.hca_cnt = cat("hca_cnt", -1, layer.hca_cnt)
    layer.index.codes = cat("index_codes", 2, layer.index.codes)
    if layer.index.scales is not None:
        layer.index.scales = cat("index_scales", 2, layer.index.scales)
    layer.valid = cat("valid", -1, layer.valid)
    for name in ("sink_k", "sink_v", "win_k", "win_v", "open_k", "open_v"):
        setattr(layer, name, last[p + name].to(dev).clone())
    layer.v_sum = last[p + "v_sum"].to(dev).clone()  # config fingerprints keep older records out
    rq = last.get(p + "recent_q")
    layer.recent_q = None if rq is None else rq.to(dev).clone()
    ids = sorted({int(n[len(p) :].split(".")[1]) for n in last if n.startswith(p + "csa.")})
    layer.csa_blocks = deque(
        (bid, last[f"{p}csa.{bid}.k"].to(dev), last[f"{p}csa.{bid}.v"].to(dev), last[f"{p}csa.{bid}.cnt"].to(dev))
        for bid in ids
    )
    meta = last[p + "meta"]
    layer.tokens_seen, layer.sealed = int(meta[0]), int(meta[1])
    layer.scaling = float(last[p + "scaling"][0])
    layer._rebuild_band()
    layer.resume_exact_prompt()  # an exact prompt (prefill_exact_tokens) goes on exactly


def record_bytes(record: dict[str, Any]) -> int:
    return sum(int(t.nbytes) for t in record.values())
