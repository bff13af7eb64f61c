"""A decode step with fixed shapes and no host reads (`decode_step: static`).

On an accelerator eager PyTorch costs the host time for every operator (63 us a kernel in
flashmem's step on an H200, docs/accelerator.md), and an operator whose result the host reads
(a count, a boolean mask's size, `unique`) makes it wait for the device's queue. A CUDA graph
replays a fixed list of kernels for under a microsecond each, but only a list whose shapes,
addresses and control flow do not depend on values on the device. This module is that list for
the decode steps between two seals: a *segment*, in which the sealed blocks, their index and
the cold arena do not change.

Per step, per layer:

1. The new token is written into the recent tier: the open block and the window in one buffer
   of W + B tokens, at a cursor kept on the device.
2. The index scores every page (as the eager step does) and takes the top k. The k slots are
   held through the segment, so k is the selection's size without `lsa_open_room`'s extra
   pages: those borrow the open block's unused room, which a segment fills one token a step,
   and holding them to its end would pass the budget by the open block's size.
3. A selected page the working set holds keeps its slot; each other page takes the slot of one
   that left (a sort and a gather, not a boolean mask whose size the host would read).
4. The new pages are read from the cold arena in one gather of a fixed size: every ranked
   position, or with `lsa_fetch_share` s the c = ceil(s * k) positions with new pages first. A
   position whose page is held rewrites its own slot with the same bytes (int8: the same codes,
   since coding is per token), so the padding of a fixed-size read changes nothing. A new page
   past c waits for the next step; its slot keeps the page it held, masked out.
5. One attention over sinks | working set | recent tier, with a bias per key.

A step that seals a block runs the eager path (`tiered_attention.py`), and so does everything
else (the prompt, a row change, a crop); the next decode step starts a new segment from the
layer's state. During a segment the layer's window, open block and working set are views of
the segment's buffers, so the memory report, `export_state` and the eager path read the same
state; the segment notices (by identity) when any of them was replaced and starts again.

The first step of a segment reads every selected page (the working set starts empty); on CUDA
the gather reads the host arena through a device view of its pinned memory where
`store/mapped.py` can make one, otherwise the page ids cross to the host first (one wait).

With `lsa_open_room: false` its logits equal the eager step's; with it, the eager step's with
`lsa_open_room: false` (tests/test_static_step.py).

Shapes: q [b, Hq, 1, d]; qg [b, h, group, d]; ranked ids, slots [b, h, k]; recent tier
[2 (K, V), b, h, W + B, d]; working set [2, b, h, k * P, d] (int8: and scales [2, b, h, k * P, 1]);
bias [b, h, S + k * P + W + B].
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from flashmem.cache import sdpa
from flashmem.cache.assembly import NEG, step_scratch
from flashmem.cache.page_codes import PageCodes
from flashmem.index.selection import index_mass, ranked_pages
from flashmem.store.mapped import device_view
from flashmem.store.memory import MemoryStore

if TYPE_CHECKING:
    from flashmem.cache.flash_layer import FlashLayer


class StaticStep:
    """One layer's decode steps of one segment (see the module's docstring)."""

    @staticmethod
    def applies(layer: FlashLayer) -> bool:
        """Whether a segment can start now: blocks sealed, sinks and window full, room in the
        open block, pages to select, and the sealed blocks in a memory store's arena."""
        cfg = layer.cfg
        n = layer.num_sealed
        return (
            n > 0
            and layer.selection_hook is None
            and layer.latent is None
            and not layer.scorer.uses_hca_entries
            and isinstance(layer.store, MemoryStore)
            and layer.sink_k.shape[-2] == cfg.sink_tokens
            and layer.win_k.shape[-2] == cfg.gpu_cache_limit
            and layer.open_k.shape[-2] + 1 < cfg.hca_chunk_size
            and cfg.blocks_to_select(n * cfg.pages_per_block) > 0
            and layer.store.block_run(layer.layer_idx, 0, n) is not None
        )

    def __init__(self, layer: FlashLayer) -> None:
        cfg = self.cfg = layer.cfg
        self.layer = layer
        b, h, S, d = layer.sink_k.shape
        dev, dt = layer.sink_k.device, layer.sink_k.dtype
        W, B, P, ppb = cfg.gpu_cache_limit, cfg.hca_chunk_size, cfg.page_tokens, cfg.pages_per_block
        n = self.sealed = layer.num_sealed
        pages = n * ppb
        self.rows = (b, h)
        self.dtype, self.P, self.ppb = dt, P, ppb
        # the steps this segment takes: open block lengths open0 .. B - 2 before each append (the
        # step that fills it seals, eagerly)
        open0 = layer.open_k.shape[-2]
        self.steps_left = B - 1 - open0
        k = self.k = min(pages, cfg.blocks_to_select(pages))  # held through the segment: no open room
        share = cfg.lsa_fetch_share
        self.fetch = k if share is None else min(k, max(1, math.ceil(share * k)))
        # the sealed pages' validity and index: fixed in a segment
        self.page_tokens_valid = layer.block_valid_tokens().reshape(b, pages, P)
        self.page_valid = self.page_tokens_valid.any(-1)  # [b, pages]
        run = layer.store.block_run(layer.layer_idx, 0, n)
        assert run is not None  # applies() checked
        self.int8 = cfg.working_set_codec == "int8"
        # what the step gathers from, as page rows: an int8 working set's pages coded on the host
        # (cache/page_codes.py: codes [slots*2*b*h*ppb, P*d], scales [.., P], K's block then V's),
        # else the cold tier's exact arena (K and V [n*b*h*ppb, P*d] each)
        if self.int8:
            if layer.page_codes is None:
                layer.page_codes = PageCodes()
            layer.page_codes.sync(*run)
            codes, scales = layer.page_codes.codes, layer.page_codes.scales
            assert codes is not None and scales is not None
            self.arena: tuple[torch.Tensor, ...] = (
                device_view(codes, dev).view(-1, P * d),
                device_view(scales, dev).view(-1, P),
            )
            self.block_stride = 2 * b * h * ppb  # page rows of one block, K and V
        else:
            self.arena = tuple(device_view(t, dev).view(-1, P * d) for t in run)
            self.block_stride = b * h * ppb
        # K and V stacked (index 0, 1) so that each write is one operator for both:
        # the recent tier (open block, then window) [2, b, h, W + B, d]
        r = open0 + W
        self.recent = torch.zeros(2, b, h, W + B, d, dtype=dt, device=dev)
        self.recent[0, :, :, :r] = torch.cat([layer.open_k, layer.win_k], dim=-2)
        self.recent[1, :, :, :r] = torch.cat([layer.open_v, layer.win_v], dim=-2)
        self.cursor = torch.tensor([r], dtype=torch.long, device=dev)
        self.r = r  # recent tokens (host count: the views and the seal point)
        # the working set: k slots of P tokens, K and V stacked; empty (-1) until the first
        # step fills every slot
        self.ids = torch.full((b, h, k), -1, dtype=torch.long, device=dev)
        self.codes = torch.zeros(2, b, h, k * P, d, dtype=torch.int8 if self.int8 else dt, device=dev)
        self.scales = torch.ones(2, b, h, k * P, 1, dtype=torch.float32, device=dev) if self.int8 else None
        self.ws_valid = torch.zeros(b, h, k * P, dtype=torch.bool, device=dev)
        # bias per key: sinks | working set | recent tier (the recent tier's room hidden)
        self.at_ws, self.at_recent = S, S + k * P
        L = self.at_recent + W + B
        self.bias = torch.full((b, h, L), NEG, dtype=dt, device=dev)
        o0 = S + n * B
        recent_valid = torch.zeros(b, W + B, dtype=torch.bool, device=dev)
        recent_valid[:, :r] = layer.valid[:, o0 : o0 + r]
        self.bias[:, :, :S].masked_fill_(layer.valid[:, None, :S], 0.0)
        self.bias[:, :, self.at_recent :].masked_fill_(recent_valid[:, None], 0.0)
        # index arithmetic, made once: a (row, head)'s first slot row and first arena page row
        bh = torch.arange(b * h, device=dev).view(b, h, 1)
        self.slot_base = bh * k
        self.page_base = bh * ppb
        self.kv_rows = torch.tensor([0, b * h * k], device=dev).view(2, 1)  # K's slot rows, then V's
        self.kv_pages = torch.tensor([0, b * h * ppb], device=dev).view(2, 1)  # a coded block's K, then V
        self.bi = torch.arange(b, device=dev)[:, None, None]
        self.all_pages = torch.tensor(b * h * k, device=dev)  # attended when every page is read
        self.zero_neg = torch.tensor([0.0, NEG], dtype=dt, device=dev)
        # what one page of one row and KV head takes over the link as gathered (K and V): its
        # codes and per-token scales, or its exact bytes
        self.page_read_bytes = 2 * P * (d + 4) if self.int8 else layer.reader.page_bytes()
        self.filled = False  # the first step reads every selected page
        # what _publish handed the layer (a step checks they are still there: `serves`)
        self._open: torch.Tensor = layer.open_k
        self._win: torch.Tensor = layer.win_k
        self._ws_code: list[tuple[torch.Tensor, ...]] = []
        self._publish()

    # ------------------------------------------------------------------ segment
    def serves(self, layer: FlashLayer) -> bool:
        """Whether this decode step belongs to the segment: the same layer state (nothing
        replaced the views it handed out) and room before the next seal."""
        ws = layer.working_set
        return (
            self.steps_left > 0
            and layer.num_sealed == self.sealed
            and layer.open_k is self._open
            and layer.win_k is self._win
            and (not self.filled or ws.code[0] is self._ws_code[0])
        )

    def bookkeeping_bytes(self) -> int:
        """Device bytes the segment holds beside the tiers' own: the bias per key, the slots'
        page ids and token validity."""
        return sum(t.nbytes for t in (self.bias, self.ids, self.ws_valid))

    def _publish(self) -> None:
        """The layer's window and open block as views of the recent tier (and, once filled,
        its working set as views of the slots, in slot order as the eager step keeps it)."""
        layer, W = self.layer, self.cfg.gpu_cache_limit
        o = self.r - W
        rk, rv = self.recent[0], self.recent[1]
        layer.open_k, layer.open_v = rk[:, :, :o], rv[:, :, :o]
        layer.win_k, layer.win_v = rk[:, :, o : self.r], rv[:, :, o : self.r]
        self._open, self._win = layer.open_k, layer.win_k
        if self.filled:
            ws = layer.working_set
            if self.scales is not None:
                self._ws_code = [(self.codes[0], self.scales[0]), (self.codes[1], self.scales[1])]
            else:
                self._ws_code = [(self.codes[0],), (self.codes[1],)]
            ws.code = list(self._ws_code)
            ws.plain = [None, None]
            ws.idx, ws.valid = self.ids, self.ws_valid
            ws._owned = True  # the eager step may write into the slots in place
            ws.served, ws.sealed_at = None, self.sealed

    # ------------------------------------------------------------------ step
    def run(
        self,
        q: torch.Tensor,
        qg: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        valid_new: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """One decode step: q [b, Hq, 1, d], qg [b, h, group, d], k_new, v_new [b, h, 1, d],
        valid_new [b, 1] -> [b, Hq, 1, d]; the token is appended to the layer."""
        layer = self.layer
        every = self.fetch >= self.k or not self.filled
        b, h = self.rows
        L, group = self.bias.shape[-1], q.shape[1] // h
        scratch = step_scratch()  # attention's K/V and mask, reused by every layer and step
        kv = scratch.take("static_kv", (2, b, h, L, q.shape[-1]), self.dtype, q.device)
        mask = scratch.take("mask", (b, h, group, 1, L), self.dtype, q.device)
        out, hits, attended = self.device_step(q, qg, k_new, v_new, valid_new, scaling, every, kv, mask)
        # the layer's bookkeeping, on the host (the counts are read when the step closes)
        reader = layer.reader
        # attention's buffer written and read back; int8 pages decoded into it in two passes
        # (a copy, then the scale); the index converted for its scores
        ws_bytes = kv[:, :, :, self.at_ws : self.at_recent].nbytes if self.scales is not None else 0
        copied = 2 * kv.nbytes + 2 * ws_bytes + 2 * layer.index.converted_bytes(qg.dtype)
        reader.traffic.add("device_copy_bytes", copied)
        reader.traffic.pages(hits, attended - hits, reader.page_bytes())
        read = self.k if every else self.fetch
        reader.traffic.cold_read(layer.store, q.device, b * h * read * self.page_read_bytes)
        self.r += 1
        self.steps_left -= 1
        self.filled = True
        layer.validity.append(valid_new)
        self._publish()
        return out

    def device_step(
        self,
        q: torch.Tensor,
        qg: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        valid_new: torch.Tensor,
        scaling: float,
        every: bool,
        kv: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's device work, operators only: nothing read on the host, every shape fixed
        in the segment (`every`: read every ranked page, else `fetch` of them; kv
        [2, b, h, L, d] and mask [b, h, group, 1, L]: attention's buffers) -> the attention's
        output [b, Hq, 1, d], the attended pages held already and all attended (0-dim counts).
        torch.compile(fullgraph=True) traces it whole (tests/test_static_step.py)."""
        layer, cfg = self.layer, self.cfg
        b, h = self.rows
        k, P, ppb = self.k, self.P, self.ppb
        # 1. the token into the recent tier; it sees itself (as the eager step: padded or not)
        self.recent.index_copy_(3, self.cursor, torch.stack([k_new, v_new]))
        recent_bias = self.bias[:, :, self.at_recent :]
        recent_bias.index_fill_(-1, self.cursor, 0.0)
        # 2. rank: the index's pooled mass (as the eager step), the top k pages in rank order
        scores = layer.index.score(layer.scorer, qg, scaling)  # [b, h, group, pages]
        mass = index_mass(scores, self.page_valid, scaling, cfg.lsa_pool, cfg.lsa_share_heads)
        ranked = ranked_pages(mass, self.page_valid[:, None, :], k, cfg.lsa_follow_pages)  # [b, h, k]
        # 3. slots: a held page keeps its own; the others take the free ones in order
        match = ranked[..., :, None] == self.ids[..., None, :]  # [b, h, k ranked, k slots]
        held = match.any(-1)
        src = match.to(torch.int8).argmax(-1)
        free = match.any(-2).to(torch.int8).argsort(dim=-1, stable=True)  # free slots first, ascending
        rank = (~held).cumsum(-1).sub_(1).clamp_min_(0)
        slot = torch.where(held, src, free.gather(-1, rank))  # [b, h, k], a permutation
        # 4. the new pages, one gather of a fixed size (held pages as padding rewrite themselves)
        if every:
            pos, pid, pslot = None, ranked, slot
        else:
            pos = held.to(torch.int8).argsort(dim=-1, stable=True)[..., : self.fetch]  # new pages first
            pid, pslot = ranked.gather(-1, pos), slot.gather(-1, pos)
        blk = pid.div(ppb, rounding_mode="floor")
        arena_rows = (blk * (self.block_stride - ppb) + pid + self.page_base).view(-1)  # [b*h*c]: K's
        slot_rows = ((self.slot_base + pslot).view(1, -1) + self.kv_rows).view(-1)  # [2*b*h*c]: K's, then V's
        if self.scales is not None:  # coded on the host: codes and scales, K and V in one gather each
            rows = (arena_rows.view(1, -1) + self.kv_pages).view(-1)
            self.codes.view(2 * b * h * k, -1).index_copy_(0, slot_rows, _gather(self.arena[0], rows, q.device))
            self.scales.view(2 * b * h * k, P).index_copy_(0, slot_rows, _gather(self.arena[1], rows, q.device))
        else:
            pages = torch.cat([_gather(t, arena_rows, q.device) for t in self.arena])  # [2*b*h*c, P*d]
            self.codes.view(2 * b * h * k, -1).index_copy_(0, slot_rows, pages)
        self.ids.scatter_(-1, pslot, pid)
        # 5. what it attends: its pages in their slot (with a cap, not the new ones left waiting)
        tokens_valid = self.page_tokens_valid[self.bi, self.ids]  # [b, h, k, P]
        if pos is None:
            attended = self.all_pages
            self.ws_valid.view(b, h, k, P).copy_(tokens_valid)
        else:
            got = held.clone().scatter_(-1, pos, True)  # ranked pages now in their slot
            attended = got.sum()
            slot_on = torch.zeros_like(held).scatter_(-1, slot, got)  # [b, h, k] by slot
            torch.logical_and(tokens_valid, slot_on[..., None], out=self.ws_valid.view(b, h, k, P))
        ws_bias = self.bias[:, :, self.at_ws : self.at_recent]
        ws_bias.copy_(torch.where(self.ws_valid, self.zero_neg[0], self.zero_neg[1]))
        out = self._attend(q, scaling, kv, mask)
        # the token's own bias from here on: its validity
        recent_bias.index_copy_(-1, self.cursor, self.zero_neg[(~valid_new).long()][:, None, :].expand(b, h, 1))
        self.cursor.add_(1)
        return out, held.sum(), attended

    def _attend(self, q: torch.Tensor, scaling: float, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One attention over sinks | working set | recent tier, assembled in kv [2, b, h, L, d]
        with the bias copied to each query head's mask [b, h, group, 1, L]."""
        b, h = self.rows
        S, at_r = self.at_ws, self.at_recent
        L = self.bias.shape[-1]
        group = q.shape[1] // h
        kv[0, :, :, :S] = self.layer.sink_k
        kv[1, :, :, :S] = self.layer.sink_v
        ws = kv[:, :, :, S:at_r]
        ws.copy_(self.codes)  # int8 codes are exact in the model's dtype; then their scales
        if self.scales is not None:
            ws.mul_(self.scales)
        kv[:, :, :, at_r:] = self.recent
        mask.copy_(self.bias[:, :, None, None, :])
        return sdpa.attention(q, kv[0], kv[1], mask.view(b, h * group, 1, L), scaling, group > 1)


def _gather(rows_of: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """rows_of[rows] on `device`: gathered where the rows lie when the device can read them (a
    CPU, or a mapped view), else on the host after the ids cross to it (a wait), then copied."""
    if rows_of.device == rows.device:
        return rows_of.index_select(0, rows)
    return rows_of.index_select(0, rows.to(rows_of.device)).to(device, non_blocking=True)
