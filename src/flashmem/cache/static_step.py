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

With `lsa_rerank` r > 1 (and `lsa_rerank_on_device`, a key code), step 2 takes the index's top
C = max(r k, `lsa_rerank_min_pages`) candidates instead, and their keys' codes pick the k: the
codes are held on the device in the ranker's own slots (cache/rerank_codes.py
`DeviceCandidates`, which the eager step of a seal updates too), assigned as in step 3, the
new candidates' codes gathered from the host's code arena in one read of a fixed size (every
candidate, or with `lsa_fetch_share` s as many as pages, ceil(s k), new ones first: candidates
change less from step to step than pages do; a new candidate past it waits a step and is not a
candidate until then).

A step that seals a block runs the eager path (`tiered_attention.py`), and so does everything
else (the prompt, a row change, a crop); the next decode step starts a new segment from the
layer's state. During a segment the layer's window, open block and working set are views of
the segment's buffers, so the memory report, `export_state` and the eager path read the same
state; the segment notices (by identity) when any of them was replaced and starts again.

The first step of a segment reads every selected page (the working set starts empty); on CUDA
the gather reads the host arena through a device view of its pinned memory where
`store/mapped.py` can make one, otherwise the page ids cross to the host first (one wait).

With `decode_step: graph` each layer's `device_step` is captured in a CUDA graph once per
segment and replayed (cache/step_graph.py).

With `lsa_open_room: false` its logits equal the eager step's; with it, the eager step's with
`lsa_open_room: false` (tests/test_static_step.py).

Shapes: q [b, Hq, 1, d]; qg [b, h, group, d]; ranked ids, slots [b, h, k]; candidates [b, h, C]
and their held codes q [b, h, S >= C, P, d * bits / 8], zero / scale [b, h, S, 1, d]; recent tier
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
from flashmem.cache.rerank_codes import RerankCodes
from flashmem.cache.step_graph import StepGraph, graph_kind
from flashmem.compress import key_code
from flashmem.index.rerank import coded_page_mass
from flashmem.index.selection import index_mass, ranked_pages
from flashmem.sizing.tiers import rerank_candidates
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
        self._init_rerank(layer, k)
        # decode_step graph: the segment's steps after its first replayed from a CUDA graph, where
        # the device reads the cold tier (and the codes) itself (cache/step_graph.py)
        readable = all(t.device == dev for t in self.arena) and (
            not self.rerank or all(t.device == dev for t in self.code_arena)
        )
        kind = graph_kind(dev, readable) if cfg.decode_step == "graph" else None
        self.graph: StepGraph | None = None
        if kind is not None:
            state = [t for n, t in vars(self).items() if isinstance(t, torch.Tensor) and not n.startswith("_")]
            self.graph = StepGraph(kind, state, layer.graph_counts)
        # what _publish handed the layer (a step checks they are still there: `serves`)
        self._open: torch.Tensor = layer.open_k
        self._win: torch.Tensor = layer.win_k
        self._ws_code: list[tuple[torch.Tensor, ...]] = []
        self._publish()

    def _init_rerank(self, layer: FlashLayer, k: int) -> None:
        """lsa_rerank with codes on the device: C candidates a step, their codes in the ranker's
        slots (grown to C here, on the host, where a segment may still wait)."""
        cfg, ranker = self.cfg, layer.ranker
        b, h = self.rows
        dev = self.page_valid.device
        pages = self.page_valid.shape[-1]
        self.C = rerank_candidates(cfg, pages, k) if ranker.device_codes is not None else 0
        self.rerank: bool = self.C > k
        self.cand_hits = torch.zeros((), dtype=torch.long, device=dev)  # 0 without a re-rank
        if not self.rerank:
            return
        codes, held = ranker.codes, ranker.device_codes
        assert isinstance(codes, RerankCodes) and held is not None
        reader = layer.reader
        codes.fill(self.sealed, lambda j: reader.fetch_block(j, on_host=True)[0])
        assert codes.q is not None and codes.zero is not None and codes.scale is not None
        self.cidx, code = held.reserve(b, h, self.C, codes, dev)
        self.cq, self.cz, self.cs = code.q, code.zero, code.scale  # [b, h, S, P, w], [b, h, S, 1, d]
        self.code_bits = code.bits
        share = cfg.lsa_fetch_share
        # as many candidates' codes a step as pages: of the candidates 3-7% are new a step where 16-32%
        # of the pages are (docs/accelerator.md, "Re-rank codes held on the device")
        self.cfetch = self.C if share is None else min(self.C, self.fetch)
        # the host arena as rows the gather reads: a page's codes [P * w], a block's zero / scale
        # per (row, head) [d]; the same row arithmetic as the cold arena's pages
        w, d = self.cq.shape[-1], self.cz.shape[-1]
        self.code_arena: tuple[torch.Tensor, ...] = tuple(
            device_view(t, dev) for t in (codes.q, codes.zero, codes.scale)
        )
        self.code_rows = (self.code_arena[0].view(-1, self.P * w),) + tuple(t.view(-1, d) for t in self.code_arena[1:])
        S = self.cidx.shape[-1]
        bh = torch.arange(b * h, device=dev).view(b, h, 1)
        self.cand_base, self.bh = bh * S, bh
        self.code_dtype = torch.float32 if dev.type == "cpu" else self.dtype  # as the eager re-rank
        # what one candidate's code takes over the link: its P keys, its block's zero and scale
        self.cand_read_bytes = self.P * w * self.cq.element_size() + 2 * d * self.cz.element_size()
        self._held = held

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
            and (not self.rerank or self._held.idx is self.cidx)
        )

    def bookkeeping_bytes(self) -> int:
        """Device bytes the segment holds beside the tiers' own: the bias per key, the slots'
        page ids and token validity."""
        return sum(t.nbytes for t in (self.bias, self.ids, self.ws_valid))  # the codes: the index's

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
        res = None
        if self.graph is not None and self.filled:  # after the first step `every` stays as it is
            res = self.graph.run(
                self.device_step,
                [q, qg, k_new, v_new, valid_new],
                (scaling, every),
                lambda: (torch.empty_like(kv), torch.empty_like(mask)),  # inside a capture: the pool's
                (kv, mask),
            )
        if res is None:
            res = self.device_step(q, qg, k_new, v_new, valid_new, scaling, every, kv, mask)
        out, hits, attended, cand_hits = res
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
        if self.rerank:  # the candidates' codes: the fixed gather's, as for the pages
            cands = b * h * self.C
            reader.traffic.add("h2d_bytes", b * h * (self.C if every else self.cfetch) * self.cand_read_bytes)
            reader.traffic.candidates(cand_hits, cands - cand_hits)
            reader.traffic.add("device_read_bytes", cands * self.cand_read_bytes)
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's device work, operators only: nothing read on the host, every shape fixed
        in the segment (`every`: read every ranked page, else `fetch` of them; kv
        [2, b, h, L, d] and mask [b, h, group, 1, L]: attention's buffers) -> the attention's
        output [b, Hq, 1, d], the attended pages held already and all attended, the re-rank's
        candidates held already (0-dim counts).
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
        allowed = self.page_valid[:, None, :]
        cand_hits = self.cand_hits
        if self.rerank:  # the index's C candidates, their codes' mass picks the k
            mass, allowed, cand_hits = self._rerank(qg, mass, scaling, every)
        ranked = ranked_pages(mass, allowed, k, cfg.lsa_follow_pages)  # [b, h, k]
        # 3. slots: a held page keeps its own; the others take the free ones in order
        # 4. the new pages, one gather of a fixed size (held pages as padding rewrite themselves)
        slot, held, pos, pid, pslot = _admit(ranked, self.ids, None if every else self.fetch)
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
        own = torch.where(valid_new, self.zero_neg[0], self.zero_neg[1])  # [b, 1]: 0, or -inf for padding
        recent_bias.index_copy_(-1, self.cursor, own[:, None, :].expand(b, h, 1))
        self.cursor.add_(1)
        return out, held.sum(), attended, cand_hits

    def _rerank(
        self, qg: torch.Tensor, mass: torch.Tensor, scaling: float, every: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The index's mass [b, h, pages] -> the candidates' mass by their codes, scattered over
        the pages ([b, h, pages], -1 elsewhere), the pages allowed (the candidates whose codes
        are held) and the candidates held already (0-dim): as the eager re-rank
        (cache/ranking.py `rerank_coded`), with a gather of a fixed size."""
        cfg = self.cfg
        b, h = self.rows
        ppb, C = self.ppb, self.C
        cand = ranked_pages(mass, self.page_valid[:, None, :], C, cfg.lsa_follow_pages)  # [b, h, C]
        cslot, cheld, pos, pid, pslot = _admit(cand, self.cidx, None if every else self.cfetch)
        blk = pid.div(ppb, rounding_mode="floor")
        page_rows = (blk * (b * h * ppb - ppb) + pid + self.page_base).view(-1)  # the codes of P keys
        block_rows = (blk * (b * h) + self.bh).view(-1)  # their block's zero and scale
        dest = (self.cand_base + pslot).view(-1)
        S = self.cidx.shape[-1]
        for held_t, arena, rows in zip(
            (self.cq, self.cz, self.cs), self.code_rows, (page_rows, block_rows, block_rows)
        ):
            held_t.view(b * h * S, -1).index_copy_(0, dest, _gather(arena, rows, qg.device))
        self.cidx.scatter_(-1, pslot, pid)
        cvalid = self.page_tokens_valid[self.bi, cand]  # [b, h, C, P]
        got = None if pos is None else cheld.clone().scatter_(-1, pos, True)
        if got is not None:  # a new candidate past the read waits: not a candidate this step
            cvalid = cvalid & got[..., None]
        code = key_code.KeyCode(self.cq, self.cz, self.cs, self.code_bits)
        cmass = coded_page_mass(
            qg.to(self.code_dtype), code, cvalid, scaling, cfg.lsa_pool, cfg.lsa_share_heads, cslot
        )  # [b, h, C]
        dense = torch.full_like(mass, -1.0).scatter_(-1, cand, cmass.to(mass.dtype))
        on = torch.ones_like(cheld) if got is None else got
        allowed = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, cand, on) & self.page_valid[:, None, :]
        return dense, allowed, cheld.sum()

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


def _slots(ranked: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots for pages ranked [b, h, c] (distinct) among slots holding ids [b, h, S >= c] (-1:
    none): a held page keeps its own, the others take the free ones (holding no ranked page) in
    ascending order -> (slot [b, h, c], distinct; held [b, h, c] bool). Sorts and searches, no
    [c, S] match (1,024 candidates a head at 128K), and nothing the host reads."""
    c, S = ranked.shape[-1], ids.shape[-1]
    order = ids.argsort(dim=-1)
    by_id = ids.gather(-1, order)
    at = torch.searchsorted(by_id, ranked).clamp_max_(S - 1)
    held = by_id.gather(-1, at) == ranked
    src = order.gather(-1, at)  # a held page's slot
    wanted = ranked.sort(dim=-1).values
    taken = wanted.gather(-1, torch.searchsorted(wanted, ids).clamp_max_(c - 1)) == ids  # [b, h, S]
    free = taken.to(torch.int8).argsort(dim=-1, stable=True)  # free slots first, ascending
    rank = (~held).cumsum(-1).sub_(1).clamp_min_(0)
    return torch.where(held, src, free.gather(-1, rank)), held


def _admit(
    ranked: torch.Tensor, ids: torch.Tensor, fetch: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`_slots`, and what a fixed-size read brings in: every ranked page (fetch None), or the
    first `fetch` positions with new pages first -> (slot, held [b, h, c]; the positions read
    [b, h, fetch] or None; their page ids and slots [b, h, fetch or c])."""
    slot, held = _slots(ranked, ids)
    if fetch is None:
        return slot, held, None, ranked, slot
    pos = held.to(torch.int8).argsort(dim=-1, stable=True)[..., :fetch]  # new pages first
    return slot, held, pos, ranked.gather(-1, pos), slot.gather(-1, pos)


def _gather(rows_of: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """rows_of[rows] on `device`: gathered where the rows lie when the device can read them (a
    CPU, or a mapped view), else on the host after the ids cross to it (a wait), then copied."""
    if rows_of.device == rows.device:
        return rows_of.index_select(0, rows)
    return rows_of.index_select(0, rows.to(rows_of.device)).to(device, non_blocking=True)
