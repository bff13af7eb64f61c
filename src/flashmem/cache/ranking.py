"""Candidate ranking: which sealed pages a chunk of queries attends exactly.

The index (a `BlockScorer` over `IndexVectors`, or the HCA entries) scores every
page; `index/selection.py` picks the top ones per KV head. With `lsa_rerank` r > 1
the index picks r x k candidates (at least `lsa_rerank_min_pages`) and their exact
keys keep the k with the most attention mass (`index/rerank.py`): read from the
cold tier page by page, or scored in place where a memory store holds every
block's keys on the compute device (`block_keys`).

`rank` returns a `Selection`: the chosen page ids and, when the candidates' K/V
were read to re-rank them, those too, so the working set is cut from them rather
than read again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashmem.cache.block_reads import BlockReader
from flashmem.cache.rerank_codes import HOST, DeviceCandidates, KeyMirror, RerankCodes
from flashmem.config import FlashMemoryConfig
from flashmem.index.base import BlockScorer
from flashmem.index.rerank import (
    coded_page_mass,
    exact_block_mass,
    exact_page_mass,
    streamed_page_mass,
    token_page_mass,
)
from flashmem.index.selection import (
    blocked_index_mass,
    feedback_pages,
    index_mass,
    pooled_in_blocks,
    score_rows,
    top_pages,
)
from flashmem.index.vectors import IndexVectors

# (layer_idx, selected page ids [b, h, k] sorted, index scores [b, h, nq, n]) -> page ids
# [b, h, k] sorted: a diagnostic override of the selection (see FlashMemoryCache.selection_hook).
SelectionHook = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]

# Selections scored by at most this many queries are re-ranked (`lsa_rerank`): decode
# steps, the prompt's tail (cache/attention.py), short teacher-forced chunks, and long
# prefill chunks when `lsa_prefill_queries` samples at most this many of their queries.
# Re-ranking with all of a long chunk's hundreds of queries costs r times its attention
# (tiny model, 32K at 1/8: prefill 33 s -> 169 s when every chunk was re-ranked).
RERANK_MAX_QUERIES = 64
# Re-rank candidates' keys are scored in place, over every block (`rerank_in_place`), when
# they are at least 1/IN_PLACE_CANDIDATES of the pages: copying a page's keys out costs about
# 3x (SmolLM2 at 8K) to 7x (tiny model at 32K-64K) scoring one in place, one CPU thread
# (benchmarks/micro_decode_parts.py).
IN_PLACE_CANDIDATES = 3


@dataclass
class Candidates:
    """Re-rank candidates read this step: page ids [b, h, c] sorted, their keys
    [b, h, c, P, d] and values (None: only keys were read), on the device or, ranked on
    the host (`BlockReader.host_ranking`), in host memory."""

    ids: torch.Tensor
    k: torch.Tensor | None  # None once handed over (`take`)
    v: torch.Tensor | None
    on_host: bool = False

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The keys and values, handed over once: the candidates stop holding them, so the
        working set that cuts its pages out of them frees each as soon as it has its cut (a
        layer's candidate keys are the largest transient of a disk tier's decode step)."""
        k, v = self.k, self.v
        assert k is not None, "the candidates' keys were handed over already"
        self.k = self.v = None
        return k, v


@dataclass
class Selection:
    idx: torch.Tensor  # page ids [b, h, k], sorted
    candidates: Candidates | None = None


class CandidateRanker:
    """One layer's index stage and re-rank."""

    def __init__(
        self, layer_idx: int, cfg: FlashMemoryConfig, scorer: BlockScorer, reader: BlockReader, index: IndexVectors
    ) -> None:
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.scorer = scorer
        self.reader = reader
        self.index = index
        # lsa_rerank_codec: the candidates are scored by a code of their keys kept on the host
        coded = cfg.lsa_rerank > 1 and cfg.lsa_rerank_codec != "exact"
        # lsa_rerank_mirror: the in-place re-rank scores a host copy of every sealed key instead.
        # Both sit in `codes`: the layer extends them as blocks seal, row changes select their rows
        self.codes: RerankCodes | KeyMirror | None = None
        if coded:
            self.codes = RerankCodes(cfg.lsa_rerank_codec, cfg.hca_chunk_size, cfg.page_tokens)
        elif cfg.lsa_rerank > 1 and cfg.lsa_rerank_mirror != "none":
            self.codes = KeyMirror(cfg.lsa_rerank_mirror, cfg.hca_chunk_size)
        # lsa_rerank_on_device: this step's candidates' codes held on the device, scored there
        self.device_codes = DeviceCandidates() if coded and cfg.lsa_rerank_on_device else None
        self._last_cand: torch.Tensor | None = None  # the last re-rank's candidates (counted only)
        self._last_all: int | None = None  # ... when they were every page: how many
        # lsa_feedback_share: each sealed page's mean value, the second hop's summaries (host, fp32)
        self.page_values: PageValues | None = None
        if cfg.lsa_feedback_share > 0:
            self.page_values = PageValues(cfg.hca_chunk_size, cfg.page_tokens)

    def key_copy(self, num_sealed: int) -> KeyMirror | None:
        """The int8 key copy (`lsa_rerank_mirror: int8`) where it can hand the working set its
        new pages' key codes (`KeyMirror.page_codes`): it holds every one of the num_sealed
        blocks and lies in the memory the working set is in (a CPU); else None."""
        m = self.codes
        if not isinstance(m, KeyMirror) or m.dtype != "int8" or self.reader.device.type != "cpu":
            return None
        return m if m.n >= num_sealed else None

    def device_nbytes(self) -> int:
        """Device bytes the re-rank holds: its candidates' codes with `lsa_rerank_on_device`."""
        return 0 if self.device_codes is None else self.device_codes.nbytes()

    def host_nbytes(self) -> int:
        """Host bytes the re-rank keeps beside the cold tier: its block codes or key copy."""
        return 0 if self.codes is None else self.codes.nbytes()

    def scores(self, qg: torch.Tensor, scaling: float, hca_k: torch.Tensor) -> torch.Tensor:
        """Index scores of every page for queries qg [b, h, nq, d] -> [b, h, nq, n_pages]
        (hca_k [b, h, n, d]: the HCA entries, for a scorer that ranks by them)."""
        if self.scorer.uses_hca_entries:
            return self.scorer.score(qg, hca_k[:, :, :, None], scaling)
        self.reader.traffic.add("device_copy_bytes", 2 * self.index.converted_bytes(qg.dtype))
        return self.index.score(self.scorer, qg, scaling)

    def index_mass(
        self,
        qg: torch.Tensor,
        page_valid: torch.Tensor,
        scaling: float,
        hca_k: torch.Tensor,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The index's pooled mass per page [b, h, n_pages] for queries qg [b, h, nq, d]
        (page_valid [b, n_pages]): from `scores` when the caller holds them whole, else scored
        a block of queries at a time (index/selection.py `blocked_index_mass`), so that a long
        prompt chunk's transient stays bounded whatever the context."""
        cfg = self.cfg
        if scores is not None:
            return index_mass(scores, page_valid, scaling, cfg.lsa_pool, cfg.lsa_share_heads)
        return blocked_index_mass(
            lambda q: self.scores(q, scaling, hca_k), qg, page_valid, scaling, cfg.lsa_pool, cfg.lsa_share_heads
        )

    def rank(
        self,
        mass: Callable[[], torch.Tensor],
        page_valid: torch.Tensor,
        k_sel: int,
        scaling: float,
        qg: torch.Tensor | None = None,
        page_tokens_valid: torch.Tensor | None = None,
        num_sealed: int = 0,
    ) -> Selection:
        """Top `k_sel` pages per KV head from the index's pooled mass [b, h, n_pages] (`mass()`,
        `index_mass`: computed once, and only where a stage reads it, so not when every page is
        a re-rank candidate); page_valid: [b, n_pages]. With `lsa_rerank` r > 1 (qg [b, h, nq,
        d] and page_tokens_valid [b, n_pages, P] given) the index picks r * k_sel candidates (at
        least `lsa_rerank_min_pages`) and their exact keys pick the k_sel. With
        `lsa_feedback_share` a share of the k_sel goes to the second hop (`feedback`)."""
        cfg = self.cfg
        cap = cfg.lsa_rerank_max_tokens
        rerank = qg is not None and page_tokens_valid is not None
        rerank = rerank and (cap is None or num_sealed * cfg.hca_chunk_size <= cap)
        pooled = functools.cache(mass)
        n_pages = page_valid.shape[-1]
        n_cand = min(max(k_sel * cfg.lsa_rerank, cfg.lsa_rerank_min_pages) if rerank else k_sel, n_pages)
        every = n_cand > k_sel and n_cand == n_pages  # every page a candidate: no index stage
        sel: Selection | None = None
        if n_cand > k_sel and isinstance(self.codes, RerankCodes):
            assert qg is not None and page_tokens_valid is not None
            b, h = qg.shape[:2]
            cand = (
                torch.arange(n_pages, device=qg.device).expand(b, h, n_pages)
                if every
                else self._index_top(pooled(), page_valid, n_cand)
            )
            sel = self.rerank_coded(cand, qg, page_tokens_valid, k_sel, scaling, num_sealed)
        elif every:
            assert qg is not None and page_tokens_valid is not None
            self._count_every_page(qg.shape[0], qg.shape[1], n_pages, qg.device)
            sel = self.rerank_in_place(qg, page_tokens_valid, k_sel, scaling, num_sealed)
        if sel is None:
            idx = self._index_top(pooled(), page_valid, n_cand)
            sel = Selection(idx)
            if n_cand > k_sel:
                assert qg is not None and page_tokens_valid is not None
                self._count_candidates(idx)
                ranked = None
                if IN_PLACE_CANDIDATES * n_cand >= n_pages:
                    ranked = self.rerank_in_place(qg, page_tokens_valid, k_sel, scaling, num_sealed, idx)
                sel = ranked if ranked is not None else self.rerank(idx, qg, page_tokens_valid, k_sel, scaling)
        if self.page_values is not None:
            sel = self.feedback(sel, pooled(), page_valid, num_sealed)
        return sel

    def _index_top(self, mass: torch.Tensor, page_valid: torch.Tensor, n: int) -> torch.Tensor:
        """The index's n pages of most pooled mass [b, h, n_pages] per KV head -> sorted ids
        [b, h, n] (index/selection.py `select_blocks`, from the mass)."""
        return top_pages(mass, page_valid[:, None, :], n, self.cfg.lsa_follow_pages)

    def feedback(self, sel: Selection, mass: torch.Tensor, page_valid: torch.Tensor, num_sealed: int) -> Selection:
        """`lsa_feedback_share` of the selected pages sel.idx [b, h, k] to the pages whose mean
        values look most like the `lsa_feedback_seeds` picks of most index mass (mass
        [b, h, n]): index/selection.py `feedback_pages`. The mean values are read once per
        sealed block, on the host."""
        cfg, pv = self.cfg, self.page_values
        assert pv is not None
        k = sel.idx.shape[-1]
        share = int(round(cfg.lsa_feedback_share * k))
        n = mass.shape[-1]
        if share <= 0 or k >= n:
            return sel
        pv.fill(num_sealed, lambda j: self.reader.fetch_block(j, on_host=True)[1])
        vecs = pv.means[:, :, :n].to(mass.device)
        idx = feedback_pages(sel.idx, mass, vecs, page_valid[:, None, :], share, cfg.lsa_feedback_seeds)
        return Selection(idx, sel.candidates)

    def rerank(
        self, cand: torch.Tensor, qg: torch.Tensor, page_tokens_valid: torch.Tensor, k_sel: int, scaling: float
    ) -> Selection:
        """The k_sel of the candidate pages cand [b, h, c] (sorted) with the most exact
        attention mass for queries qg [b, h, nq, d]; the candidates' K/V come back with
        the choice, for this step's working set."""
        cfg = self.cfg
        b, h, c = cand.shape
        bi = torch.arange(b, device=cand.device)[:, None, None]
        cvalid = page_tokens_valid[bi, cand]  # [b, h, c, P]
        streamed = self._rerank_streamed(cand, qg, cvalid, page_tokens_valid, k_sel, scaling)
        if streamed is not None:
            return streamed
        if self.reader.host_ranking:  # scored next to the keys; only ids cross back
            got = self.reader.arena_pages(cand, values=False, on_host=True)
            if got is not None and got[0] is not None:
                ck = got[0]
                mass = exact_page_mass(
                    qg.to(ck.device), ck, cvalid.to(ck.device), scaling, cfg.lsa_pool, cfg.lsa_share_heads
                ).to(cand.device)
                return Selection(self._top(cand, mass, page_tokens_valid, k_sel))
            # a store without an arena (disk): the candidates' blocks are read into host memory
            # and scored there; the winners are cut from them and only those cross the link
            hk, hv = self.reader.pages_of_blocks(cand, torch.unique(cand // cfg.pages_per_block), on_host=True)
            mass = exact_page_mass(
                qg.to(hk.device), hk, cvalid.to(hk.device), scaling, cfg.lsa_pool, cfg.lsa_share_heads
            )
            return Selection(
                self._top(cand, mass.to(cand.device), page_tokens_valid, k_sel), Candidates(cand, hk, hv, True)
            )
        ck, cv = self._read_candidates(cand)  # [b, h, c, P, d]; cv None: read for the winners only
        mass = exact_page_mass(qg, ck, cvalid, scaling, cfg.lsa_pool, cfg.lsa_share_heads)  # [b, h, c]
        return Selection(self._top(cand, mass, page_tokens_valid, k_sel), Candidates(cand, ck, cv))

    def _rerank_streamed(
        self,
        cand: torch.Tensor,
        qg: torch.Tensor,
        cvalid: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        k_sel: int,
        scaling: float,
    ) -> Selection | None:
        """`rerank` with the candidates' keys read from a store that cuts pages out of blocks
        (a disk tier's page reads, a memory store's arena: `BlockReader.arena_pages`) a chunk
        of at most `BlockReader.read_chunk_bytes` at a time, each dropped once scored (index/rerank.py
        `streamed_page_mass`); the winners' K/V are read by the working set afterwards (their
        keys a second time). None where the candidates' keys fit in one read or there is no bound
        (`rerank` reads them whole and hands them to the working set) or the store cannot read
        pages so.
        cand [b, h, c] sorted; cvalid [b, h, c, P]."""
        reader = self.reader
        on_host, bound = reader.host_ranking, reader.read_chunk_bytes()
        if bound is None or (reader.prefetcher is not None and not on_host):  # device reads: the prefetcher's
            return None
        b, h, c = cand.shape
        d = qg.shape[-1]
        where = HOST if on_host else reader.device
        per_cand = b * h * self.cfg.page_tokens * d * reader.dtype.itemsize  # one candidate's keys
        step = max(1, bound // max(1, per_cand))
        if step >= c:
            return None

        def keys_of(s: int, e: int) -> torch.Tensor | None:
            got = reader.arena_pages(cand[:, :, s:e], values=False, on_host=on_host)
            return None if got is None else got[0]

        q = qg.to(where, reader.dtype)
        cfg = self.cfg
        mass = streamed_page_mass(q, keys_of, cvalid.to(where), scaling, cfg.lsa_pool, cfg.lsa_share_heads, step)
        if mass is None:
            return None
        return Selection(self._top(cand, mass.to(cand.device), page_tokens_valid, k_sel))

    def rerank_coded(
        self,
        cand: torch.Tensor,
        qg: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        k_sel: int,
        scaling: float,
        num_sealed: int,
    ) -> Selection:
        """`rerank` with the candidates cand [b, h, c] scored by their keys' codes
        (`lsa_rerank_codec`, cache/rerank_codes.py): held on the device with
        `lsa_rerank_on_device` (the new candidates' codes copied), else by host compute where
        the codes lie when the layer ranks on the host (or computes there), else copied to the
        device. Nothing of the candidates' K/V is read; the winners' pages are."""
        cfg, reader, codes = self.cfg, self.reader, self.codes
        assert isinstance(codes, RerankCodes)
        codes.fill(num_sealed, lambda j: reader.fetch_block(j, on_host=True)[0])
        if self.device_codes is not None:  # held on the device: only new candidates' codes cross
            where = reader.device
            code, slots, nbytes, copied = self.device_codes.update(cand, codes, where)
            reader.traffic.add("h2d_bytes", nbytes)
            reader.traffic.candidates(cand.numel() - copied, copied)
            reader.traffic.add("device_read_bytes", code.nbytes * cand.shape[-1] // code.q.shape[2])
        else:
            self._count_candidates(cand)
            slots = None
            code, nbytes = codes.pages(cand)
            on_host = reader.host_ranking or reader.device.type == "cpu"
            where = HOST if on_host else reader.device
            reader.traffic.add("host_read_bytes" if on_host else "h2d_bytes", nbytes)
            code = code.to(where)
        bi = torch.arange(cand.shape[0], device=cand.device)[:, None, None]
        cvalid = page_tokens_valid[bi, cand].to(where)  # [b, h, c, P]
        # the host scores in fp32 (its bf16 matmuls are slow); a device in the queries' dtype
        dtype = torch.float32 if where.type == "cpu" else qg.dtype
        mass = coded_page_mass(
            qg.to(where, dtype), code, cvalid, scaling, cfg.lsa_pool, cfg.lsa_share_heads, slots
        )  # [b, h, c]: decoded a chunk of candidates at a time
        return Selection(self._top(cand, mass.to(cand.device), page_tokens_valid, k_sel))

    def _count_every_page(self, b: int, h: int, n_pages: int, device: torch.device) -> None:
        """`_count_candidates` for every page a candidate (ids 0..n_pages-1 in each row and head):
        after a re-rank that also had every page, the hits are its page count, no search."""
        prev, last_all = self._last_cand, self._last_all
        if prev is None or last_all is None or prev.shape[:2] != (b, h) or last_all > n_pages:
            self._count_candidates(torch.arange(n_pages, device=device).expand(b, h, n_pages))
        else:
            self._last_cand = torch.arange(n_pages, device=device).expand(b, h, n_pages)
            self.reader.traffic.candidates(b * h * last_all, b * h * (n_pages - last_all))
        self._last_all = n_pages

    def _count_candidates(self, cand: torch.Tensor) -> None:
        """Count how many of this re-rank's candidates cand [b, h, c] (sorted) the last one also
        had: what codes held on the device (`lsa_rerank_on_device`) would not copy again."""
        prev = self._last_cand
        self._last_cand, self._last_all = cand, None
        if prev is None or prev.shape[:2] != cand.shape[:2] or not prev.shape[-1]:
            self.reader.traffic.candidates(0, cand.numel())
            return
        prev = prev.contiguous()
        pos = torch.searchsorted(prev, cand.contiguous()).clamp_max_(prev.shape[-1] - 1)
        hits = (prev.gather(-1, pos) == cand).sum()  # read when the step closes: no wait here
        self.reader.traffic.candidates(hits, cand.numel() - hits)

    def _top(self, cand: torch.Tensor, mass: torch.Tensor, page_tokens_valid: torch.Tensor, k_sel: int) -> torch.Tensor:
        """The k_sel candidates cand [b, h, c] with the most mass [b, h, c] -> page ids [b, h, k_sel]."""
        b, h, _ = cand.shape
        n_pages = page_tokens_valid.shape[1]
        dense = torch.full((b, h, n_pages), -1.0, device=cand.device).scatter(-1, cand, mass)
        allowed = torch.zeros(b, h, n_pages, dtype=torch.bool, device=cand.device).scatter(-1, cand, True)
        allowed &= page_tokens_valid.any(-1)[:, None, :]
        return top_pages(dense, allowed, k_sel, self.cfg.lsa_follow_pages)

    def rerank_in_place(
        self,
        qg: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        k_sel: int,
        scaling: float,
        num_sealed: int,
        cand: torch.Tensor | None = None,
    ) -> Selection | None:
        """`rerank` with the keys read where the store holds them (one batched matmul over
        every block, no copy into page order); candidates cand [b, h, c] (None: every page)
        by masking the others' tokens, the same softmax over the candidates. None where the
        store cannot hand keys over so (`BlockReader.block_keys`). With `lsa_rerank_mirror`,
        ranked on the host, the keys are the mirror's (one GEMM over every sealed token)."""
        cfg, reader = self.cfg, self.reader
        mirror = self.codes if isinstance(self.codes, KeyMirror) else None
        if mirror is not None and not (reader.host_ranking or reader.device.type == "cpu"):
            mirror = None  # on an accelerator the arena's keys on the device are scored
        block_k = None
        if mirror is None:
            block_k = reader.block_keys(num_sealed)
            if block_k is None:
                return None
        b, n_pages, P = page_tokens_valid.shape
        allowed = page_tokens_valid.any(-1)[:, None, :]  # [b, 1, pages]
        valid = page_tokens_valid[:, None]  # [b, 1, pages, P]
        if cand is not None:
            h = cand.shape[1]
            chosen = torch.zeros(b, h, n_pages, dtype=torch.bool, device=cand.device).scatter_(-1, cand, True)
            allowed = allowed & chosen
            valid = valid & chosen[..., None]
        # Every query's logits over every sealed token [b, h, rows, T], a block of queries at a
        # time: a prompt tail's (RERANK_MAX_QUERIES positions x the GQA group) grow with the context
        # (one layer of Llama-3.1-8B's heads at 32K: 248 MiB whole; docs/results.md, stop 65).
        # Each block of queries reads the keys again: counted as such.
        T, nq = num_sealed * cfg.hca_chunk_size, qg.shape[2]
        if mirror is not None:
            mirror.fill(num_sealed, lambda j: reader.fetch_block(j, on_host=True)[0])
            rows = score_rows(b, qg.shape[1], T, HOST)
            reader.traffic.add("host_read_bytes", mirror.nbytes() * -(-nq // min(rows, nq)))
            tokens = valid.flatten(-2).to(HOST)  # [b, 1 or h, num_sealed * B]: the mirror's tokens

            def mass_of(q: torch.Tensor, share: bool) -> torch.Tensor:
                return token_page_mass(mirror.logits(q, scaling), tokens, P, 1.0, cfg.lsa_pool, share)

        else:
            assert block_k is not None
            where = block_k.device  # the compute device, or the host (`host_ranking`): only ids cross back
            rows = score_rows(b, qg.shape[1], T, where)
            if rows < nq:  # block_keys counted the first read
                reader.traffic.cold_read(reader.store, reader.device, block_k.nbytes * (-(-nq // rows) - 1), True)
            on_where = valid.flatten(-2).to(where)

            def mass_of(q: torch.Tensor, share: bool) -> torch.Tensor:
                return exact_block_mass(q.to(where), block_k, on_where, P, scaling, cfg.lsa_pool, share)

        mass = pooled_in_blocks(mass_of, qg, rows, cfg.lsa_pool, cfg.lsa_share_heads)  # [b, h, pages]
        return Selection(top_pages(mass.to(qg.device), allowed, k_sel, cfg.lsa_follow_pages))

    def _read_candidates(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Exact keys of pages idx [b, h, c] -> k [b, h, c, P, d] and v: from the memory
        store's arena only the keys (v None: the winners' values are read after), else
        both, cut from whole blocks read once each."""
        got = self.reader.arena_pages(idx, values=False)
        if got is not None:
            assert got[0] is not None
            return got[0], None
        return self.reader.pages_of_blocks(idx, torch.unique(idx // self.cfg.pages_per_block))


class PageValues:
    """Each sealed page's mean value [b, h, n_pages, d] (fp32, host memory), filled as blocks
    seal: the second hop's summaries (`lsa_feedback_share`). Values carry no RoPE, so the same
    words at two positions have about the same mean value (keys do not)."""

    def __init__(self, block_tokens: int, page_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.means = torch.zeros(0)
        self.blocks = 0

    def fill(self, num_sealed: int, values_of: Callable[[int], torch.Tensor]) -> None:
        """Add the blocks sealed since the last call; values_of(j): block j's values [b, h, B, d]."""
        if num_sealed < self.blocks:  # cropped (generation's crop): the blocks past it go
            self.means = self.means[:, :, : num_sealed * (self.block_tokens // self.page_tokens)]
            self.blocks = num_sealed
        new = []
        for j in range(self.blocks, num_sealed):
            v = values_of(j).float().cpu()
            b, h, B, d = v.shape
            new.append(v.view(b, h, B // self.page_tokens, self.page_tokens, d).mean(-2))
        if new:
            self.means = torch.cat(([self.means] if self.blocks else []) + new, dim=2)
            self.blocks = num_sealed
