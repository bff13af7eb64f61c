"""A FlashLayer's state at a prefix boundary, exported and imported incrementally.

`export` gives what the layer gained since a mark (append-only parts: sealed blocks'
K/V as the cold tier holds them, their HCA entries and index pages, the validity of
the new positions) plus its bounded tail now (sinks, open block, window, recent
queries, the near band's CSA entries, the sealed values' sum). `load` replays such
records, in order, into a fresh layer. The server's prefix reuse
(`flashmem.serve.state`) goes through `FlashLayer.export_state` / `load_state`, so
the layer's fields are written in one place only.

Tensor names are the layer's own (the caller prefixes them); every tensor is on the
CPU, contiguous.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from flashmem.cache.flash_layer import FlashLayer

TAIL = ("sink_k", "sink_v", "win_k", "win_v", "open_k", "open_v")


class LayerMark(NamedTuple):
    """Where the layer's append-only parts end: sealed blocks, index pages, positions."""

    sealed: int = 0
    pages: int = 0
    valid: int = 0


def mark(layer: FlashLayer) -> LayerMark:
    if not layer.is_initialized:
        return LayerMark()
    return LayerMark(layer.sealed, layer.index.count, layer.valid.shape[-1])


def export(layer: FlashLayer, since: LayerMark) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            out[name] = t.detach().to("cpu").contiguous()

    s0, s1 = since.sealed, layer.sealed
    for j in range(s0, s1):
        # through the reader's store: after a beam reorder it maps each row to its stored row
        k, v = layer.reader.store.get((layer.layer_idx, j), "cpu")
        put(f"block.{j}.k", k)
        put(f"block.{j}.v", v)
    summ = layer.summaries
    if summ.hca_k.shape[-2]:
        put("hca_k", summ.hca_k[:, :, s0:s1])
        put("hca_v", summ.hca_v[:, :, s0:s1])
        put("hca_cnt", summ.hca_cnt[:, s0:s1])
    put("index_codes", layer.index.codes[:, :, since.pages :])
    if layer.index.scales is not None:
        put("index_scales", layer.index.scales[:, :, since.pages :])
    put("valid", layer.valid[:, since.valid :])
    for name in TAIL:
        put(name, getattr(layer, name))
    put("recent_q", layer.summaries.recent_q)
    put("v_sum", layer.v_sum)
    for bid, ck, cv, cc in summ.csa_blocks:
        put(f"csa.{bid}.k", ck)
        put(f"csa.{bid}.v", cv)
        put(f"csa.{bid}.cnt", cc)
    put("meta", torch.tensor([layer.tokens_seen, layer.sealed], dtype=torch.long))
    put("scaling", torch.tensor([layer.scaling], dtype=torch.float64))
    return out


def load(layer: FlashLayer, records: list[dict[str, torch.Tensor]]) -> None:
    """Rebuild, in a fresh layer, the state after the last of `records` (those of
    boundaries 1..j, in order, each `export`'s output)."""
    last = records[-1]
    layer.lazy_initialization(last["sink_k"], last["sink_v"])
    dev = layer.device
    for r in records:
        for name, t in r.items():
            if name.startswith("block.") and name.endswith(".k"):
                j = int(name.split(".")[1])
                layer.store.put((layer.layer_idx, j), t.to(dev), r[name[:-2] + ".v"].to(dev))

    def cat(name: str, dim: int, into: torch.Tensor) -> torch.Tensor:
        parts = [r[name].to(dev) for r in records if name in r]
        return torch.cat([into, *parts], dim=dim) if parts else into

    summ = layer.summaries
    summ.hca_k = cat("hca_k", -2, summ.hca_k)
    summ.hca_v = cat("hca_v", -2, summ.hca_v)
    summ.hca_cnt = cat("hca_cnt", -1, summ.hca_cnt)
    layer.index.codes = cat("index_codes", 2, layer.index.codes)
    if layer.index.scales is not None:
        layer.index.scales = cat("index_scales", 2, layer.index.scales)
    layer.valid = cat("valid", -1, layer.valid)
    for name in TAIL:
        setattr(layer, name, last[name].to(dev).clone())
    layer.v_sum = last["v_sum"].to(dev).clone()  # config fingerprints keep older records out
    rq = last.get("recent_q")
    summ.recent_q = None if rq is None else rq.to(dev).clone()
    ids = sorted({int(n.split(".")[1]) for n in last if n.startswith("csa.")})
    summ.csa_blocks = deque(
        (bid, last[f"csa.{bid}.k"].to(dev), last[f"csa.{bid}.v"].to(dev), last[f"csa.{bid}.cnt"].to(dev)) for bid in ids
    )
    meta = last["meta"]
    layer.tokens_seen, layer.sealed = int(meta[0]), int(meta[1])
    layer.scaling = float(last["scaling"][0])
    summ.rebuild_band()
    layer.resume_exact_prompt()  # an exact prompt (prefill_exact_tokens) goes on exactly
