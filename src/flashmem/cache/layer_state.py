"""A FlashLayer's state at a prefix boundary, exported and imported incrementally.

`export` gives what the layer gained since a mark, and `load` replays such records,
in order, into a fresh layer. The server's prefix reuse (`flashmem.serve.state`)
goes through `FlashLayer.export_state` / `load_state`, so the layer's fields are
written in one place only.

What a record holds (format 2):

- `kv.k`, `kv.v` [b, h, n, d]: the K/V of every position seen since the mark, in
  token order, wherever it lives now (sinks, sealed blocks in the cold tier, open
  block, window). Records 1..j together hold every position once: `load` cuts their
  concatenation into sinks | sealed blocks | open block | window by the lengths in
  `meta`, so the bounded tail (sinks, open block, window) is never stored twice (in
  format 1 every record carried its own copy of it: about a third of the bytes at the
  recipe's 512-token blocks). The store codes these pairs with the cold tier's codec
  (`flashmem.serve.prefix`).
- small parts, as they are: the new index pages (`index_codes`, `index_scales`), the
  validity of the new positions, HCA entries of the new blocks, the near band's CSA
  entries, the fusion rule's recent queries, the sealed values' sum, `meta`
  (tokens seen, sealed blocks, sink, open and window lengths) and `scaling`. The index
  pages are the ones computed from the exact keys, so selection after a restore ranks
  as a fresh prefill does.

A layer whose cold tier holds low-rank coefficients (`cold_low_rank`) cannot give its
sealed blocks' exact K/V back: its records hold the new blocks in the cold tier's form
(`block.<j>.k/.v`) and the exact tail at the boundary (`sink`, `open`, `win` .k/.v).

Tensor names are the layer's own (the caller prefixes them); every tensor is on the
CPU, contiguous.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from flashmem.cache.flash_layer import FlashLayer

TAIL = ("sink", "open", "win")  # the bounded tail's tiers (their .k/.v), for the low-rank layout


class LayerMark(NamedTuple):
    """Where the layer's append-only parts end: sealed blocks, index pages, positions."""

    sealed: int = 0
    pages: int = 0
    valid: int = 0


def mark(layer: FlashLayer) -> LayerMark:
    if not layer.is_initialized:
        return LayerMark()
    return LayerMark(layer.sealed, layer.index.count, layer.valid.shape[-1])


def span(layer: FlashLayer, a: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of positions a..e-1 in order, on the CPU, from wherever they live now:
    sinks [0, S), sealed block j [S + jB, S + (j+1)B) (cold tier), open block, window."""
    B = layer.cfg.hca_chunk_size
    S = layer.block_start
    seal_end = S + layer.sealed * B
    open_end = seal_end + layer.open_k.shape[-2]
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(k: torch.Tensor, v: torch.Tensor, lo: int) -> None:
        s, t = max(a, lo), min(e, lo + k.shape[-2])
        if s < t:
            parts.append((k[:, :, s - lo : t - lo].cpu(), v[:, :, s - lo : t - lo].cpu()))

    take(layer.sink_k, layer.sink_v, 0)
    for j in range(max(0, (a - S) // B), layer.sealed):
        lo = S + j * B
        if lo >= e:
            break
        # through the reader's store: after a beam reorder it maps each row to its stored row
        k, v = layer.reader.store.get((layer.layer_idx, j), "cpu")
        take(k, v, lo)
    take(layer.open_k, layer.open_v, seal_end)
    take(layer.win_k, layer.win_v, open_end)
    k = torch.cat([p[0] for p in parts], dim=-2)
    v = torch.cat([p[1] for p in parts], dim=-2)
    assert k.shape[-2] == e - a, "the tiers hold every position seen once"
    return k, v


def export(layer: FlashLayer, since: LayerMark) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            out[name] = t.detach().to("cpu").contiguous()

    s0, s1 = since.sealed, layer.sealed
    if layer.latent is None:
        k, v = span(layer, since.valid, layer.valid.shape[-1])
        put("kv.k", k)
        put("kv.v", v)
    else:  # the cold tier's form of the new blocks, and the exact tail
        for j in range(s0, s1):
            k, v = layer.reader.store.get((layer.layer_idx, j), "cpu")
            put(f"block.{j}.k", k)
            put(f"block.{j}.v", v)
        for name in TAIL:
            put(f"{name}.k", getattr(layer, f"{name}_k"))
            put(f"{name}.v", getattr(layer, f"{name}_v"))
    summ = layer.summaries
    if summ.hca_k.shape[-2]:
        put("hca_k", summ.hca_k[:, :, s0:s1])
        put("hca_v", summ.hca_v[:, :, s0:s1])
        put("hca_cnt", summ.hca_cnt[:, s0:s1])
    put("index_codes", layer.index.codes[:, :, since.pages :])
    if layer.index.scales is not None:
        put("index_scales", layer.index.scales[:, :, since.pages :])
    put("valid", layer.valid[:, since.valid :])
    put("recent_q", layer.summaries.recent_q)
    put("v_sum", layer.v_sum)
    for bid, ck, cv, cc in summ.csa_blocks:
        put(f"csa.{bid}.k", ck)
        put(f"csa.{bid}.v", cv)
        put(f"csa.{bid}.cnt", cc)
    lengths = (layer.tokens_seen, layer.sealed, layer.sink_k.shape[-2], layer.open_k.shape[-2], layer.win_k.shape[-2])
    put("meta", torch.tensor(lengths, dtype=torch.long))
    put("scaling", torch.tensor([layer.scaling], dtype=torch.float64))
    return out


def load(layer: FlashLayer, records: list[dict[str, torch.Tensor]]) -> None:
    """Rebuild, in a fresh layer, the state after the last of `records` (those of
    boundaries 1..j, in order, each `export`'s output). ValueError when they do not
    fit together (the store's checks make that a bug, not damage)."""
    last = records[-1]
    seen, sealed, S, O, W = (int(x) for x in last["meta"])
    B = layer.cfg.hca_chunk_size
    if "kv.k" in last:
        k = torch.cat([r["kv.k"] for r in records], dim=-2)
        v = torch.cat([r["kv.v"] for r in records], dim=-2)
        if k.shape[-2] != seen or S + sealed * B + O + W != seen:
            raise ValueError(f"layer {layer.layer_idx}: prefix records of {k.shape[-2]} positions, state of {seen}")
        layer.lazy_initialization(k, v)
        dev = layer.device
        k, v = k.to(dev), v.to(dev)
        for j in range(sealed):
            a = S + j * B
            layer.store.put((layer.layer_idx, j), k[:, :, a : a + B], v[:, :, a : a + B])
        o = S + sealed * B
        layer.sink_k, layer.sink_v = k[:, :, :S].clone(), v[:, :, :S].clone()
        layer.open_k, layer.open_v = k[:, :, o : o + O].clone(), v[:, :, o : o + O].clone()
        layer.win_k, layer.win_v = k[:, :, o + O :].clone(), v[:, :, o + O :].clone()
        kv: tuple[torch.Tensor, torch.Tensor] | None = (k, v)
    else:  # low-rank cold tier: blocks in its form, the exact tail of the last record
        layer.lazy_initialization(last["sink.k"], last["sink.v"])
        dev = layer.device
        for r in records:
            for name, t in r.items():
                if name.startswith("block.") and name.endswith(".k"):
                    j = int(name.split(".")[1])
                    layer.store.put((layer.layer_idx, j), t.to(dev), r[name[:-2] + ".v"].to(dev))
        for name in TAIL:
            setattr(layer, f"{name}_k", last[f"{name}.k"].to(dev).clone())
            setattr(layer, f"{name}_v", last[f"{name}.v"].to(dev).clone())
        kv = None

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
    layer.v_sum = last["v_sum"].to(dev).clone()  # config fingerprints keep older records out
    rq = last.get("recent_q")
    summ.recent_q = None if rq is None else rq.to(dev).clone()
    ids = sorted({int(n.split(".")[1]) for n in last if n.startswith("csa.")})
    summ.csa_blocks = deque(
        (bid, last[f"csa.{bid}.k"].to(dev), last[f"csa.{bid}.v"].to(dev), last[f"csa.{bid}.cnt"].to(dev)) for bid in ids
    )
    layer.tokens_seen, layer.sealed = seen, sealed
    layer.scaling = float(last["scaling"][0])
    summ.rebuild_band()
    if kv is not None:
        # a buffered exact prompt goes on from the records' K/V (no cold-tier reads, and
        # with the exact codec the very K/V a fresh prefill holds)
        every_token = kv
        layer.exact.resume(seen, lambda: every_token)
    else:
        layer.resume_exact_prompt()  # an exact prompt (prefill_exact_tokens) goes on exactly
