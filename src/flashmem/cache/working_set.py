"""The working set: the selected pages' exact K/V, held on the device for attention.

Held in the model's dtype, or (`working_set_codec: int8`) as int8 rows with one
fp32 scale per token and KV head (`compress/page_code.py`), decoded for each
step's attention. A page the last step already held keeps its place (and, int8,
its codes: a page's codes depend on its own tokens only, so keeping them equals
coding it again); only the others are read, through the layer's `BlockReader`,
or cut from this step's re-rank candidates when those were read.

With `lsa_cache_pages` s > 0 the device also keeps, per row and KV head, up to s pages
that left the selection (the most recently selected first, in slots: a page comes in
where the least recently used one was, nothing else moves): a page that comes back is
taken from there, not read again. On a CPU that saves nothing (the cold tier is the same
RAM); on an accelerator it is what the host link does not carry.

A step that keeps the number of pages (most decode steps) writes only the pages that came in,
into the slots of those that left; the others stay where they are. The working set's page ids
are then in slot order, not sorted (a step that changes the count rebuilds them sorted).

Shapes: page ids idx [b, h, k]; K/V held [b, h, k*P, d]; validity [b, h, k*P]; the spare
pages' ids [b, h, s] (-1: an empty slot) and rows [b*h*s, P*d].
"""

from __future__ import annotations

import torch

from flashmem.cache.block_reads import BlockReader
from flashmem.cache.ranking import Candidates
from flashmem.cache.rerank_codes import KeyMirror
from flashmem.compress import page_code

# A part of attention's keys or values: a tensor [b, h, n, d], or int8 codes [b, h, n, d]
# with their scales [b, h, n, 1] (the working set, decoded where attention reads it).
Part = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# Pages of the new selection the last working set holds ([b, h, k] bool) and their slots there.
Held = tuple[torch.Tensor, torch.Tensor]


class WorkingSet:
    def __init__(
        self, codec: str, page_tokens: int, dtype: torch.dtype, cache_pages: int = 0, in_place: bool = True
    ) -> None:
        self.codec = codec
        self.page_tokens = page_tokens
        self.dtype = dtype
        self.spare = SparePages(cache_pages) if cache_pages > 0 else None
        # A step that keeps the number of pages writes its new pages into the slots of those that
        # left (`_merge_in_place`), in place of rebuilding every row; pages then sit in slot order,
        # not sorted. Off where their order is seen (position_mode: window shows them in order).
        self.in_place = in_place
        # The held tensors are this set's own (made by coding or a rebuild), so writing into them
        # changes nothing else: a model-dtype set() may hold a view of what a read handed over.
        self._owned = False
        # (last selection, its rows as held, this selection): pages that left, for the spare pages;
        # spilled after the gather, or by an in-place merge before it overwrites their rows
        self._pending_spill: tuple[torch.Tensor, list[tuple[torch.Tensor, ...] | None], torch.Tensor] | None = None
        # K (0) and V (1) as held: (tensor,) or int8 (codes, scale)
        self.code: list[tuple[torch.Tensor, ...] | None] = [None, None]
        # This step's decoded copy of coded K/V (made while coding, or on first read):
        # attention, the rest entry and a partial re-gather share it; dropped at the
        # step's end (a transient, as the chunk's activations are).
        self.plain: list[torch.Tensor | None] = [None, None]
        self.idx: torch.Tensor | None = None  # page ids [b, h, k], in slot order
        self.valid: torch.Tensor | None = None  # [b, h, k*P]
        # `lsa_select_every`: decode steps served by the last selection since it was made, and
        # the sealed blocks it saw (a prompt chunk's selection serves no decode step: served None)
        self.served: int | None = None
        self.sealed_at = -1
        # the layer's bound on a decode step's decoded K/V (`BlockReader.decode_kv_bytes`; None:
        # the device's): past it attention decodes the codes a run at a time
        self.kv_bytes: int | None = None

    # ------------------------------------------------------------------ reads
    @property
    def k(self) -> torch.Tensor | None:
        """Keys [b, h, k*P, d] in the model's dtype (decoded once per step when coded)."""
        return self._read(0)

    @property
    def v(self) -> torch.Tensor | None:
        return self._read(1)

    def _read(self, slot: int) -> torch.Tensor | None:
        code = self.code[slot]
        if code is None or len(code) == 1:
            return None if code is None else code[0]
        plain = self.plain[slot]
        if plain is None:
            plain = self.plain[slot] = page_code.decode(code[0], code[1], self.dtype)
        return plain

    def part(self, slot: int) -> Part:
        """Keys (0) or values (1) for this step's attention: the decoded tensor where this
        step has one, else an int8 set's (codes, scale)."""
        code, plain = self.code[slot], self.plain[slot]
        assert code is not None
        if len(code) == 1:
            return code[0]
        return plain if plain is not None else (code[0], code[1])

    def nbytes(self) -> int:
        held = sum(t.nbytes for code in self.code if code is not None for t in code)
        return held + (0 if self.spare is None else self.spare.nbytes())

    def end_step(self) -> None:
        self.plain = [None, None]

    # ------------------------------------------------------------------ selection reuse
    def selected(self, num_sealed: int, decode: bool) -> None:
        """A selection was just gathered over num_sealed blocks, by a decode step (decode) or a
        chunk of several queries, whose pooled selection no decode step reuses."""
        self.served, self.sealed_at = (0 if decode else None), num_sealed

    def reusable(self, num_sealed: int, rows: tuple[int, int], every: int) -> bool:
        """Whether this decode step attends the last selection again (`lsa_select_every`):
        made by a decode step over the same sealed blocks and rows, fewer than every - 1
        steps ago. Decided on the host, from counts: nothing is read from the device."""
        return (
            every > 1
            and self.idx is not None
            and self.served is not None
            and self.served < every - 1
            and self.sealed_at == num_sealed
            and tuple(self.idx.shape[:2]) == rows
        )

    def reuse(self, reader: BlockReader) -> torch.Tensor:
        """This step attends the last selection's pages as held -> their ids [b, h, k]: nothing
        is ranked or read (every page counted as held)."""
        assert self.idx is not None and self.served is not None
        self.served += 1
        reader.traffic.pages(self.idx.numel(), 0, reader.page_bytes())
        return self.idx

    def clear(self) -> None:
        self.code = [None, None]
        self.plain = [None, None]
        self.idx = self.valid = None
        self.served, self.sealed_at = None, -1
        self._owned = False
        if self.spare is not None:
            self.spare.clear()

    # ------------------------------------------------------------------ writes
    def _store(self, slot: int, t: Part) -> None:
        self.plain[slot] = None
        if isinstance(t, tuple):  # int8 codes and scales made where the pages were cut (the host)
            self.code[slot] = t
            return
        if self.codec == "int8":
            # This step reads the decoded copy made in passing where a decode step attends it in
            # one run; past that, attention decodes the codes a run at a time, and a whole
            # decoded copy would only add a layer's pages in the model's dtype to the step's
            # transients (the first decode step's peak: a disk tier's RSS, docs/results.md, stop 66).
            from flashmem.cache import assembly  # deferred: assembly imports this module

            bound = assembly.decode_kv_bytes(t.device) if self.kv_bytes is None else self.kv_bytes
            whole = 2 * t.numel() * t.element_size() <= bound
            codes, scale, self.plain[slot] = page_code.encode_and_decode(t, self.dtype if whole else None)
            self.code[slot] = (codes, scale)
        else:
            self.code[slot] = (t,)
            self._owned = False

    def set(self, idx: torch.Tensor, k: Part, v: Part, page_tokens_valid: torch.Tensor) -> None:
        """idx [b, h, k] pages with their K/V [b, h, k, P, d] (int8: or given coded, (codes,
        scale [b, h, k, P, 1])) become the working set."""
        b, h, _ = idx.shape

        def rows(t: Part) -> Part:
            if isinstance(t, tuple):
                return t[0].reshape(b, h, -1, t[0].shape[-1]), t[1].reshape(b, h, -1, 1)
            return t.reshape(b, h, -1, t.shape[-1])

        # int8 codes are made here or handed over freshly coded; a model-dtype set may be a view
        self._owned = self.codec == "int8"
        self._store(0, rows(k))
        self._store(1, rows(v))
        self.valid = page_tokens_valid[torch.arange(b, device=idx.device)[:, None, None], idx].reshape(b, h, -1)
        self.idx = idx

    def merge(self, idx: torch.Tensor, held: Held, k_new: Part, v_new: Part, page_tokens_valid: torch.Tensor) -> None:
        """The working set of pages idx [b, h, k]: the pages `held` keep their rows (int8:
        their codes) from the last step's; the others' K/V k_new, v_new [n_new, P, d] (in
        (b, h, k) order) are added (int8: coded now, or given coded as (codes, scale [n_new, P, 1]))."""
        keep, src = held
        b, h, k = idx.shape
        assert self.idx is not None
        k_prev = self.idx.shape[-1]
        if self.in_place and self._owned and k == k_prev:
            self._merge_in_place(idx, held, k_new, v_new, page_tokens_valid)
            return
        rows_prev = b * h * k_prev
        bi = torch.arange(b, device=idx.device)[:, None, None]
        hi = torch.arange(h, device=idx.device)[None, :, None]
        flat = keep.reshape(-1)
        # each page's row in [last working set's pages; spare pages taken back; new pages] (one
        # index_select: index_copy_ into a fresh tensor measured 30-50x slower on CPU,
        # benchmarks/micro_decode_parts.py). src >= k_prev: a spare slot (SparePages.lookup)
        from_spare = (keep & (src >= k_prev)).reshape(-1)
        s_slots = self.spare.size if self.spare is not None else 0
        spare_rows = ((bi * h + hi) * s_slots + src - k_prev).reshape(-1)[from_spare]
        n_spare = spare_rows.numel()
        old_rows = torch.where(
            from_spare, rows_prev + from_spare.cumsum(0) - 1, ((bi * h + hi) * k_prev + src).reshape(-1)
        )
        pick = torch.where(flat, old_rows, rows_prev + n_spare + (~flat).cumsum(0) - 1)
        P = self.page_tokens
        # rows not from the last working set (spare slots taken back, new pages), in pick's order
        others = (pick >= rows_prev).nonzero().view(-1)
        from_old = torch.where(pick < rows_prev, pick, 0)  # others: any row, overwritten

        def rebuilt(old: torch.Tensor, back: tuple[torch.Tensor, ...], new: torch.Tensor) -> torch.Tensor:
            # the kept rows gathered from the old set, the others copied in: the old set and the
            # new one are held at once, not also their concatenation (a layer's whole set more, on
            # the steps whose page count changes: a disk tier's decode RSS peak, stop 67)
            out = old.index_select(0, from_old)
            if others.numel():
                rest = torch.cat([*back, new]) if back else new
                out.index_copy_(0, others, rest.index_select(0, pick[others] - rows_prev))
            return out

        for slot, fresh in ((0, k_new), (1, v_new)):
            code = self.code[slot]
            assert code is not None
            d = code[0].shape[-1]
            back = () if not n_spare or self.spare is None else self.spare.rows(slot, spare_rows)
            if len(code) == 1:  # the model's dtype: rows kept as they are
                assert isinstance(fresh, torch.Tensor)
                out = rebuilt(code[0].reshape(-1, P * d), back, fresh.reshape(-1, P * d))
                self.code[slot] = (out.view(b, h, k * P, d),)
                continue
            codes, scale = code
            # [n_new, P, d], [n_new, P, 1]: coded where they were cut (the host), or now
            new_c, new_s = fresh if isinstance(fresh, tuple) else page_code.encode(fresh)
            self.code[slot] = self.plain[slot] = None  # the old codes: held by `codes` until rebuilt
            out_c = rebuilt(codes.view(-1, P * d), back[:1], new_c.view(-1, P * d))
            del codes
            out_s = rebuilt(scale.view(-1, P), back[1:], new_s.view(-1, P))
            self.code[slot] = (out_c.view(b, h, k * P, d), out_s.view(b, h, k * P, 1))
            self.plain[slot] = None  # decoded on this step's first read
        self._owned = True  # rebuilt by index_select: fresh tensors
        self.valid = page_tokens_valid[bi, idx].reshape(b, h, -1)
        self.idx = idx

    def _merge_in_place(
        self, idx: torch.Tensor, held: Held, k_new: Part, v_new: Part, page_tokens_valid: torch.Tensor
    ) -> None:
        """merge() for a selection of as many pages as the last: a page the last working set
        holds keeps its slot; the others (from a spare slot, or new: k_new, v_new [n_new, P, d]
        or coded, in (b, h, k) order) are written into the slots of the pages that left, in
        place. A step copies the pages that came in, not the whole set (on an accelerator the
        rebuild read and wrote every selected page's bytes each step)."""
        keep, src = held
        assert self.idx is not None
        b, h, k = idx.shape
        dev, P = idx.device, self.page_tokens
        # held by the last working set: stays in its slot (without spare pages, every page held)
        in_ws = keep & (src < k) if self.spare is not None else keep
        fresh = ~keep
        occupied = torch.zeros(b, h, k, dtype=torch.int32, device=dev).scatter_add_(
            -1, src.clamp_max(k - 1), in_ws.to(torch.int32)
        )
        free = occupied.argsort(dim=-1, stable=True)  # the slots of the pages that left first, ascending
        rank = (~in_ws).long().cumsum(-1) - 1
        slot = torch.where(in_ws, src, free.gather(-1, rank.clamp_min(0)))  # [b, h, k]: a permutation
        rows = (torch.arange(b * h, device=dev).view(b, h, 1) * k + slot).reshape(-1)
        dst_new = rows[fresh.reshape(-1)]
        dst_spare = None  # pages taken back from a spare slot
        back: list[tuple[torch.Tensor, ...]] = [(), ()]
        if self.spare is not None:
            from_spare = keep & ~in_ws
            dst_spare = rows[from_spare.reshape(-1)]
        if dst_spare is not None and dst_spare.numel():  # copied out before the spill may reuse their slots
            assert self.spare is not None
            s_slots = self.spare.size
            spare_rows = ((torch.arange(b * h, device=dev).view(b, h, 1) * s_slots + src - k)[from_spare]).reshape(-1)
            back = [self.spare.rows(j, spare_rows) for j in (0, 1)]
        self._spill()  # the pages that left go to the spare slots before their rows are written over
        for j, new in ((0, k_new), (1, v_new)):
            code = self.code[j]
            assert code is not None
            d = code[0].shape[-1]
            if len(code) == 1:
                held_rows: tuple[torch.Tensor, ...] = (code[0].view(-1, P * d),)
                assert isinstance(new, torch.Tensor)
                came: tuple[torch.Tensor, ...] = (new.reshape(-1, P * d),)
            else:
                held_rows = (code[0].view(-1, P * d), code[1].view(-1, P))
                new_c, new_s = new if isinstance(new, tuple) else page_code.encode(new)
                came = (new_c.reshape(-1, P * d), new_s.reshape(-1, P))
            for i, t in enumerate(held_rows):
                if dst_spare is not None and dst_spare.numel():
                    page_code.copy_rows(t, dst_spare, back[j][i])
                if dst_new.numel():
                    page_code.copy_rows(t, dst_new, came[i])
            self.plain[j] = None  # decoded on this step's first read
        self.idx = torch.empty_like(idx).scatter_(-1, slot, idx)
        bi = torch.arange(b, device=dev)[:, None, None]
        self.valid = page_tokens_valid[bi, self.idx].reshape(b, h, -1)

    def _spill(self) -> None:
        """The pages that left the selection into the spare slots (`_pending_spill`), once."""
        pending, self._pending_spill = self._pending_spill, None
        if pending is not None and self.spare is not None:
            prev, prev_code, idx = pending
            self.spare.spill(prev, prev_code, idx, self.page_tokens)

    def no_pages(self) -> torch.Tensor:
        """The K or V of no pages, [0, P, d] (every page held over)."""
        code = self.code[0]
        assert code is not None
        return code[0].new_empty(0, self.page_tokens, code[0].shape[-1], dtype=self.dtype)

    # ------------------------------------------------------------------ gathering
    def gather(
        self,
        idx: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        reader: BlockReader,
        candidates: Candidates | None = None,
        key_copy: KeyMirror | None = None,
    ) -> None:
        """Bring the selected pages idx [b, h, k] (sorted) to the device; page_tokens_valid:
        [b, n_pages, P]. Reused as is when the selection did not change; cut from the
        re-rank candidates when they hold every page; read from a memory store's arena in
        one op without a prefetcher (an int8 set's new keys, with `key_copy`, as their codes
        cut from that int8 key copy: `KeyMirror.page_codes`); else whole blocks are read once
        each and the selected pages cut out of them."""
        prev = self.idx
        by_id = None  # prev (in slot order, `_merge_in_place`) sorted once: to compare, and for held_over
        if prev is not None:
            ids, order = prev.sort(-1)
            if prev.shape == idx.shape and torch.equal(ids, idx):
                reader.traffic.pages(idx.numel(), 0, reader.page_bytes())
                return
            by_id = (ids, order)
        held = self.held_over(idx, reader, by_id)  # pages the device holds (last working set, spare), kept
        # counted as a tensor, read when the step closes: no wait on the device here
        hits = held[0].sum() if held is not None else _held_count(prev, idx)
        reader.traffic.pages(hits, idx.numel() - hits, reader.page_bytes())
        if self.spare is not None and prev is not None and prev.shape[:2] == idx.shape[:2] and prev.shape[-1]:
            if not (reader.latent is not None and reader.direct):  # (its pages are not kept: held_over)
                self._pending_spill = (prev, list(self.code), idx)
        self._gather(idx, page_tokens_valid, reader, candidates, held, key_copy)
        self._spill()  # unless an in-place merge did, before writing over their rows

    def _gather(
        self,
        idx: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        reader: BlockReader,
        candidates: Candidates | None,
        held: Held | None,
        key_copy: KeyMirror | None = None,
    ) -> None:
        if candidates is not None and self._cut_from_candidates(idx, page_tokens_valid, held, candidates, reader):
            return
        # a store that cuts pages itself (a memory arena; a disk tier reading just the pages):
        # without a prefetcher, or ranked on the host where the pages are cut there anyway
        if (reader.direct or reader.host_ranking) and self._gather_from_arena(
            idx, page_tokens_valid, held, reader, key_copy
        ):
            return
        ppb = reader.cfg.pages_per_block
        if held is not None:  # read (and, int8, code) only the blocks of the pages not held
            new = ~held[0]
            need = torch.unique(idx[new] // ppb)
            if need.numel():
                # ranked on the host: blocks read and cut there, only the new pages cross the link
                on_host = reader.host_ranking
                k_host, v_host = reader.pages_of_blocks(idx, need, only=new, on_host=on_host)
                k_new, v_new = self._over_link(k_host, on_host, reader), self._over_link(v_host, on_host, reader)
            else:
                k_new = v_new = self.no_pages()
            self.merge(idx, held, k_new, v_new, page_tokens_valid)
            return
        self._gather_blocks(idx, page_tokens_valid, reader)

    def _gather_blocks(self, idx: torch.Tensor, page_tokens_valid: torch.Tensor, reader: BlockReader) -> None:
        """Model-dtype working set from whole blocks: a (row, head) keeps the pages it already
        holds; only the blocks of the others are read."""
        prev, P, ppb = self.idx, self.page_tokens, reader.cfg.pages_per_block
        b, h, _ = idx.shape
        bi = torch.arange(b, device=idx.device)[:, None, None]
        hi = torch.arange(h, device=idx.device)[None, :, None]
        if prev is not None and prev.shape[:2] == idx.shape[:2]:
            match = idx[..., :, None] == prev[..., None, :]  # [b, h, k, k_prev]
            held = match.any(-1)
            src = match.to(torch.int8).argmax(-1)
        else:
            held = torch.zeros_like(idx, dtype=torch.bool)
            src = torch.zeros_like(idx)
        need = torch.unique(idx[~held] // ppb)  # blocks to read
        if need.numel():
            on_host = reader.host_ranking
            new_k, new_v = reader.pages_of_blocks(idx, need, on_host=on_host)
            if on_host and self.codec == "int8" and not bool(held.any()):  # every page new: sent coded
                self.set(
                    idx, self._over_link(new_k, True, reader), self._over_link(new_v, True, reader), page_tokens_valid
                )
                return
            new_k, new_v = reader.to_device(new_k, on_host), reader.to_device(new_v, on_host)
        if held.any():
            assert self.k is not None and self.v is not None  # held: a previous working set exists
            d = self.k.shape[-1]
            old_k = self.k.view(b, h, -1, P, d)[bi, hi, src]  # [b, h, k, P, d]
            old_v = self.v.view(b, h, -1, P, d)[bi, hi, src]
            if need.numel():
                keep = held[..., None, None]
                new_k, new_v = torch.where(keep, old_k, new_k), torch.where(keep, old_v, new_v)
            else:
                new_k, new_v = old_k, old_v
        self.set(idx, new_k, new_v, page_tokens_valid)

    def held_over(
        self, idx: torch.Tensor, reader: BlockReader, by_id: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> Held | None:
        """Which of the pages idx [b, h, k] the last step's working set holds (held [b, h, k]
        bool) and where (src [b, h, k], its page slot), so only the others are read (and, int8,
        coded): the working set is the device's cache of recently selected pages. None: nothing
        to keep (no working set, other rows, or a low-rank cold tier read directly: its pages
        decode at their [b, h, k] places). by_id: the held ids sorted, with their slots
        (`self.idx.sort(-1)`), when the caller has them."""
        prev, code = self.idx, self.code[0]
        if prev is None or code is None or prev.shape[:2] != idx.shape[:2] or not prev.shape[-1]:
            if self.spare is not None:
                self.spare.clear()  # other rows (or none): the spare pages are not theirs
            return None
        if reader.latent is not None and reader.direct:
            return None
        ids, order = prev.sort(-1) if by_id is None else by_id  # prev is in slot order, idx sorted
        pos = torch.searchsorted(ids, idx.contiguous()).clamp_max_(prev.shape[-1] - 1)
        held = ids.gather(-1, pos) == idx
        src = order.gather(-1, pos)
        if self.spare is not None:  # ... or a spare slot: src = k_prev + slot
            in_spare, slot = self.spare.lookup(idx)
            in_spare &= ~held
            held = held | in_spare
            src = torch.where(in_spare, prev.shape[-1] + slot, src)
        return (held, src) if bool(held.any()) else None

    def _cut_from_candidates(
        self,
        idx: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        held: Held | None,
        candidates: Candidates,
        reader: BlockReader,
    ) -> bool:
        """The working set cut from this step's re-rank candidates, which hold every page
        idx [b, h, k] names unless a selection hook replaced them. held: `held_over`'s
        pages, not cut again. False: the candidates do not cover the selection."""
        cand = candidates.ids
        pos = torch.searchsorted(cand, idx).clamp_max(cand.shape[-1] - 1)
        if candidates.k is None or not torch.equal(cand.gather(-1, pos), idx):
            return False
        b, h, k = idx.shape
        ck, cv = candidates.take()
        c, P, d = ck.shape[2:]
        bi = torch.arange(b, device=idx.device)[:, None, None]
        hi = torch.arange(h, device=idx.device)[None, :, None]
        rows = ((bi * h + hi) * c + pos).reshape(-1)  # page rows of [b*h*c, P*d]
        new = None if held is None else ~held[0]
        if new is not None:
            rows = rows[new.reshape(-1)]

        def cut(t: torch.Tensor) -> Part:
            # candidates ranked on the host: the pages are cut there and only they cross the link
            # (new pages of an int8 working set as their codes)
            out = t.reshape(-1, P * d).index_select(0, rows.to(t.device))
            return self._over_link(
                out.view(-1, P, d) if new is not None else out.view(b, h, k, P, d), candidates.on_host, reader
            )

        # the keys cut first and the candidates' freed before the values are read: a whole set (a
        # first decode step) would otherwise hold the candidates' keys, the pages' K/V and their
        # coding's temporaries at once
        kc = cut(ck)
        del ck
        v: Part
        if cv is not None:
            v = cut(cv)
            del cv
        elif new is not None and not bool(new.any()):
            v = self.no_pages()
        else:
            got = reader.arena_pages(idx, keys=False, only=new)
            if got is None or got[1] is None:
                return False
            v = got[1]
        if held is None:
            self.set(idx, kc, v, page_tokens_valid)
        else:
            self.merge(idx, held, kc, v, page_tokens_valid)
        return True

    def _over_link(self, pages: torch.Tensor, from_host: bool, reader: BlockReader) -> Part:
        """New pages [n, P, d] for the device: cut on the host (from_host), an int8 working set's
        pages cross the link as their codes and scales (1 + 4/d bytes an element, the same codes
        the device would make: coding is per token), else as they are."""
        if from_host and self.codec == "int8":
            codes, scale = page_code.encode(pages)
            return reader.to_device(codes), reader.to_device(scale)
        return reader.to_device(pages, from_host)

    def _coded_in_chunks(
        self, idx: torch.Tensor, only: torch.Tensor | None, keys: bool, on_host: bool, reader: BlockReader
    ) -> tuple[Part | None, Part] | None:
        """An int8 working set's new pages (idx [b, h, k], those `only` marks, or all) read from
        the store a chunk of at most `BlockReader.read_chunk_bytes` at a time, coded as each arrives
        -> K (None unless `keys`) and V, each (codes [n, P, d], scales [n, P, 1]) in (b, h, k)
        order: a step with many new pages (the first decode step takes every one) holds their
        codes and one chunk in the model's dtype, not every page in it. None where they fit in
        one read or there is no bound, the set is not int8, or the store declines (the caller
        reads them whole)."""
        bound = reader.read_chunk_bytes()
        if self.codec != "int8" or bound is None:
            return None
        flat = torch.ones(idx.numel(), dtype=torch.bool) if only is None else only.reshape(-1).cpu()
        pos = flat.nonzero().view(-1)
        per_page = (1 + keys) * self.page_tokens * reader.head_dim * reader.dtype.itemsize  # K and V of one
        step = max(1, bound // max(1, per_page))
        if pos.numel() <= step:
            return None
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
        for s in range(0, pos.numel(), step):
            mask = torch.zeros(idx.numel(), dtype=torch.bool)
            mask[pos[s : s + step]] = True
            got = reader.arena_pages(idx, keys=keys, only=mask.view(idx.shape), on_host=on_host)  # cut on the host
            if got is None:
                return None
            for j, t in enumerate(got):
                if t is not None:  # [n, P, d] in (b, h, k) order, coded where it was cut (ranked on
                    # the host: `_over_link` codes them there and the codes cross the link)
                    coded = self._over_link(t, True, reader) if on_host else page_code.encode(t)
                    assert isinstance(coded, tuple)
                    parts[j].append(coded)
            del got
        k_new, v_new = ((torch.cat([c for c, _ in p]), torch.cat([sc for _, sc in p])) if p else None for p in parts)
        assert v_new is not None
        return k_new, v_new

    def _gather_from_arena(
        self,
        idx: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        held: Held | None,
        reader: BlockReader,
        key_copy: KeyMirror | None = None,
    ) -> bool:
        """A store that can cut pages out of many blocks at once (MemoryStore's arena, or a disk
        tier reading just those pages: `DiskStore.gather_pages`) hands over just the selected
        pages, no whole blocks stacked: without a prefetcher, or on the host when ranked there.
        held: `held_over`'s pages, not read again. False: the store cannot."""
        if held is not None and not bool((~held[0]).any()):
            self.merge(idx, held, self.no_pages(), self.no_pages(), page_tokens_valid)
            return True
        # ranked on the host, the new pages are cut there and cross the link (int8: as codes)
        on_host = reader.host_ranking
        only = None if held is None else ~held[0]
        # an int8 set's new keys: their codes as the int8 key copy holds them (the same code of the
        # same keys), not read in the model's dtype and coded again
        k_codes = None if self.codec != "int8" or key_copy is None else key_copy.page_codes(idx, self.page_tokens, only)
        got: tuple[Part | None, Part | None] | None = self._coded_in_chunks(idx, only, k_codes is None, on_host, reader)
        if got is None:
            got = reader.arena_pages(idx, keys=k_codes is None, only=only, on_host=on_host)
        if got is None:
            return False
        assert got[1] is not None
        if k_codes is not None:  # copied from the host like the pages it stands for: counted so
            reader.traffic.cold_read(reader.store, reader.device, sum(t.nbytes for t in k_codes))
            k_new: Part = k_codes
        else:
            assert got[0] is not None
            k_new = got[0] if isinstance(got[0], tuple) else self._over_link(got[0], on_host, reader)
        v_new = got[1] if isinstance(got[1], tuple) else self._over_link(got[1], on_host, reader)
        if held is None:
            self.set(idx, k_new, v_new, page_tokens_valid)
        else:
            self.merge(idx, held, k_new, v_new, page_tokens_valid)
        return True


class SparePages:
    """Up to `size` pages per row and KV head that left the selection, most recently
    selected kept (`lsa_cache_pages`): ids [b, h, s] (-1 empty), the step each was last
    selected, and their rows as the working set holds them (K and V: (rows [b*h*s, P*d],)
    or int8 (codes [b*h*s, P*d], scales [b*h*s, P])). Rows are written in place: a step
    copies only the pages that left the selection."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ids: torch.Tensor | None = None
        self.used: torch.Tensor | None = None  # step each slot's page was last selected; -1 empty
        self.code: list[tuple[torch.Tensor, ...] | None] = [None, None]
        self.step = 0

    def clear(self) -> None:
        self.ids = self.used = None
        self.code = [None, None]

    def nbytes(self) -> int:
        return sum(t.nbytes for code in self.code if code is not None for t in code)

    def lookup(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which pages idx [b, h, k] a slot holds ([b, h, k] bool) and the slot ([b, h, k])."""
        if self.ids is None or self.ids.shape[:2] != idx.shape[:2]:
            return torch.zeros_like(idx, dtype=torch.bool), torch.zeros_like(idx)
        ids, order = self.ids.sort(-1)
        pos = torch.searchsorted(ids, idx.contiguous()).clamp_max_(self.size - 1)
        return ids.gather(-1, pos) == idx, order.gather(-1, pos)

    def rows(self, slot: int, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """K (0) or V (1) rows of flat slots `rows` [n] (row * s + slot), as held."""
        code = self.code[slot]
        assert code is not None
        return tuple(t.index_select(0, rows) for t in code)

    def spill(
        self, prev: torch.Tensor, prev_code: list[tuple[torch.Tensor, ...] | None], idx: torch.Tensor, P: int
    ) -> None:
        """After a step selected idx [b, h, k] (sorted): the pages of the last selection prev
        [b, h, k'] (slot order; their K/V rows prev_code, [b, h, k'*P, d] as held) that left it take
        the least recently used slots; a slot whose page came back to the selection is free."""
        b, h, kp = prev.shape
        s, dev = self.size, prev.device
        if self.ids is None or self.ids.shape[:2] != (b, h):
            self.ids = torch.full((b, h, s), -1, dtype=prev.dtype, device=dev)
            self.used = torch.full((b, h, s), -1, dtype=torch.long, device=dev)
            self.code = [None, None]  # rows sized for other rows' slots are not these
        assert self.used is not None
        self.step += 1
        back, slot = self.lookup(idx)  # in the selection again: their slots are free
        if bool(back.any()):
            rows = (torch.arange(b * h, device=dev).view(b, h, 1) * s + slot)[back]
            self.ids.view(-1)[rows] = -1
            self.used.view(-1)[rows] = -1
        pos = torch.searchsorted(idx.contiguous(), prev.contiguous()).clamp_max_(idx.shape[-1] - 1)
        left = idx.gather(-1, pos) != prev  # [b, h, k'] pages that left the selection
        rank = left.long().cumsum(-1) - 1
        left &= rank < s  # more than s left: the first s are kept (all were selected last step)
        if not bool(left.any()):
            return
        order = self.used.argsort(-1)  # least recently used (and empty) slots first
        slot = order.gather(-1, rank.clamp(0, s - 1))  # [b, h, k']
        base = torch.arange(b * h, device=dev).view(b, h, 1)
        dst = (base * s + slot)[left]
        src = (base * kp + torch.arange(kp, device=dev))[left]
        self.ids.view(-1)[dst] = prev[left]
        self.used.view(-1)[dst] = self.step
        for j, code in enumerate(prev_code):
            assert code is not None
            d = code[0].shape[-1]
            flat = (
                (code[0].reshape(-1, P * d),)
                if len(code) == 1
                else (code[0].reshape(-1, P * d), code[1].reshape(-1, P))
            )
            kept = self.code[j]
            if kept is None:
                kept = self.code[j] = tuple(t.new_zeros(b * h * s, t.shape[-1]) for t in flat)
            for t, f in zip(kept, flat, strict=True):
                page_code.copy_rows(t, dst, f.index_select(0, src))


def _held_count(prev: torch.Tensor | None, idx: torch.Tensor) -> int | torch.Tensor:
    """Pages of idx [b, h, k] (sorted) the last selection prev [b, h, k'] (any order) holds
    (a 0-dim tensor where it is counted on the device)."""
    if prev is None or prev.shape[:2] != idx.shape[:2] or not prev.shape[-1]:
        return 0
    prev = prev.sort(-1).values
    src = torch.searchsorted(prev.contiguous(), idx.contiguous()).clamp_max_(prev.shape[-1] - 1)
    return (prev.gather(-1, src) == idx).sum()
