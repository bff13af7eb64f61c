"""One managed attention layer: its tiers and its step.

Step (docs/design.md, "Data flow"), per chunk of queries: score the sealed
blocks with the chunk's queries, gather the top ones exactly (the working set),
attend once over sinks | HCA entries of unselected far blocks | CSA entries of
unselected near blocks | selected blocks | open block | window | new tokens
(causal), then append the new tokens to the tiers.

Token flow ("append"): the first `sink_tokens` tokens become sinks;
later ones enter the window; tokens pushed out of the window fill the open
block; a full open block is sealed: its CSA entries, HCA entry and index
summary are computed, and its exact K/V go to the cold store. The newest
`csa_band_tokens // B` sealed blocks keep their CSA entries resident.

Positions are implicit and exact: sinks hold 0..S-1, sealed block j holds
S + j*B .. S + (j+1)*B - 1, then the open block, then the window. With
`position_mode: window` attention sees other ones (the stored keys keep their
real rotation): selected pages are re-rotated to S, S+1, .. in order, and the
open block, window, new keys and the queries are shifted to follow them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from flashmem.cache.latent import LatentKV
from flashmem.cache.lookahead import predict_next_blocks
from flashmem.cache.scratch import Scratch, thread_scratch
from flashmem.compress import page_code
from flashmem.compress.chunk_fusion import fuse_chunks
from flashmem.compress.fusion import FusionContext, FusionRule
from flashmem.config import FlashMemoryConfig
from flashmem.errors import ColdStoreError, ConfigError, FlashMemError
from flashmem.index.base import BlockScorer
from flashmem.index.rerank import exact_block_mass, exact_page_mass
from flashmem.index.selection import select_blocks, top_pages
from flashmem.index.vectors import IndexVectors
from flashmem.memory.budget import RECENT_QUERY_TOKENS
from flashmem.rope import RopeRotator
from flashmem.store.base import ColdStore
from flashmem.store.memory import MemoryStore, cut_pages
from flashmem.store.prefetch import Prefetcher

if TYPE_CHECKING:
    from flashmem.cache.guard import StepGuard

# (layer_idx, selected block ids [b, h, k] sorted, index scores [b, h, nq, n]) -> block ids
# [b, h, k] sorted: a diagnostic override of the selection (see FlashMemoryCache.selection_hook).
SelectionHook = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# A part of attention's keys or values: a tensor [b, h, n, d], or int8 codes [b, h, n, d]
# with their scales [b, h, n, 1] (the working set, decoded where attention reads it).
Part = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


# Selections scored by at most this many queries are re-ranked (`lsa_rerank`): decode
# steps, the prompt's tail (cache/attention.py), short teacher-forced chunks, and long
# prefill chunks when `lsa_prefill_queries` samples at most this many of their queries.
# Re-ranking with all of a long chunk's hundreds of queries costs r times its attention
# (tiny model, 32K at 1/8: prefill 33 s -> 169 s when every chunk was re-ranked).
RERANK_MAX_QUERIES = 64
# Re-rank candidates' keys are scored in place, over every block (`_rerank_in_place`), when
# they are at least 1/IN_PLACE_CANDIDATES of the pages: copying a page's keys out costs about
# 3x (SmolLM2 at 8K) to 7x (tiny model at 32K-64K) scoring one in place, one CPU thread
# (benchmarks/micro_decode_parts.py).
IN_PLACE_CANDIDATES = 3


class FlashLayer(CacheLayerMixin):
    """Cache layer whose attention runs through `flashmem.cache.attention`, which
    calls `take_pending` and then `step` per chunk of queries."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    selection_hook: SelectionHook | None = None
    # The cache's StepGuard (None for a layer used alone): told when a step fails half-way.
    guard: StepGuard | None = None
    # Masks span the new tokens only (see get_mask_sizes); the cache clears it when a plain
    # full layer reads the same mask.
    compact_mask: bool = True
    # Set by flashmem.prefill while it feeds a chunk that is not the prompt's end: the
    # chunk's tail is not the prompt's tail, so it does not select on its own.
    mid_prompt: bool = False
    # A step's missing blocks are queued to the prefetcher together, so its threads read them
    # in parallel instead of one synchronous read at a time (docs/measurements.md, "Scale").
    demand_batch: bool = True
    # A memory store on the CPU is read directly, not through the prefetcher (see
    # lazy_initialization); tests of the prefetcher over a memory store turn this off.
    read_memory_directly: bool = True
    # cold_low_rank: codes sealed blocks to calibrated low-rank coefficients for the store and
    # back on every read (`_seal`, `fetch_block`, `_arena_pages`); set by FlashMemoryCache.
    latent: LatentKV | None = None

    def __init__(
        self,
        layer_idx: int,
        cfg: FlashMemoryConfig,
        store: ColdStore,
        scorer: BlockScorer,
        rule: FusionRule,
        rotator: RopeRotator | None,
        *,
        prefetcher: Prefetcher | None = None,
        fetch_counts: dict[str, float] | None = None,
        lookahead_bytes: int | None = None,
    ) -> None:
        """prefetcher: reads go through it and look-ahead fills it (None: reads go
        to the store); fetch_counts: {"misses", "stall_s"} counters of synchronous
        store reads, shared by the cache's layers; lookahead_bytes: this layer's
        share of the prefetcher's ready buffer, which caps look-ahead requests."""
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.store = store
        self.scorer = scorer
        self.rule = rule
        self.rotator = rotator if cfg.fusion_rope == "rerotate" else None
        if cfg.position_mode == "window" and rotator is None:
            raise ConfigError(
                f"position_mode: window needs the model's RoPE frequencies, not found for layer {layer_idx}; "
                "allowed: position_mode: real"
            )
        self.rope = rotator  # moves attended keys and queries to window positions (position_mode: window)
        self.prefetcher = prefetcher
        self.fetch_counts = fetch_counts
        self.lookahead_bytes = lookahead_bytes
        self._pf_block_bytes: int | None = None
        self.tokens_seen = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scaling = 1.0  # the model's attention scale, set by each step (fusion reads it)
        self.peak_resident_bytes = 0

    # ------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        self.device, self.dtype = dev, dt
        if self.read_memory_directly and isinstance(self.store, MemoryStore) and dev.type == "cpu":
            # The blocks already sit in this process's RAM on the compute device: a read is a
            # dict lookup, and handing it to loader threads only adds their overhead (at 1/8
            # of 32K tokens on the tiny model, 89 -> 85 ms per decode step, 120 -> 92 with
            # the cores contended: benchmarks/profile_decode.py). On an
            # accelerator the host-to-device copy is what the prefetcher hides, so it stays.
            self.prefetcher = None
        empty = lambda n: torch.zeros(b, h, n, d, dtype=dt, device=dev)  # noqa: E731
        self.sink_k, self.sink_v = empty(0), empty(0)
        self.win_k, self.win_v = empty(0), empty(0)
        self.open_k, self.open_v = empty(0), empty(0)
        self.hca_k, self.hca_v = empty(0), empty(0)  # empty unless cfg.keeps_hca_entries
        self.sealed = 0
        self.hca_cnt = torch.zeros(b, 0, dtype=torch.long, device=dev)
        self.csa_blocks: deque[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = deque()
        self.csa_k, self.csa_v = empty(0), empty(0)
        self.csa_cnt = torch.zeros(b, 0, dtype=torch.long, device=dev)
        self.csa_page_ids = torch.zeros(0, dtype=torch.long, device=dev)
        width = self.scorer.width or d
        self.index = IndexVectors(b, h, self.scorer.vectors, width, self.cfg.lsa_index_dtype, dt, dev)
        # Sum of every sealed token's value [b, h, d] (fp32): the rest entry's value is
        # this minus the selected pages' values, over the tokens left out (empty without it).
        rest_d = d if self.cfg.keeps_rest_entry else 0
        self.v_sum = torch.zeros(b, h, rest_d, dtype=torch.float32, device=dev)
        # Validity of every position seen, in a buffer with doubling capacity: appending a
        # decode step's token copies nothing (a cat per step would copy the whole history).
        self._valid_buf = torch.zeros(b, 1024, dtype=torch.bool, device=dev)
        self._valid_len = 0
        self.recent_q: torch.Tensor | None = None  # [b, h, n, d]
        self.ws_idx: torch.Tensor | None = None  # last selection of pages [b, h, k]
        # The working set's K/V [b, h, k*P, d], as held on the device (working_set_codec:
        # int8 codes and scales); ws_k / ws_v read them in the model's dtype.
        self._ws_code: list[tuple[torch.Tensor, ...] | None] = [None, None]
        # This step's decoded copy of coded K/V (made while coding, or on first read):
        # attention, the rest entry and a partial re-gather share it; dropped at the
        # step's end (a transient, as the chunk's activations are).
        self._ws_plain: list[torch.Tensor | None] = [None, None]
        self.ws_valid: torch.Tensor | None = None  # [b, h, k*P]
        # This step's re-rank candidates (page ids [b, h, c], k, v [b, h, c, P, d]), or None.
        self._cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        # Every token's K/V [b, h, capacity, d] while the prompt is prefilled exactly
        # (prefill_exact_tokens); dropped for good at the first one-token forward or past the cap.
        self._pre_k: torch.Tensor | None = None
        self._pre_v: torch.Tensor | None = None
        self._pre_len = 0
        self._pre_want = 0  # tokens the current prompt forward brings the buffer to
        self._pre_open = self.cfg.prefill_exact_tokens > 0
        self.is_initialized = True

    # The working set (see _ws_code): coded on assignment, decoded on read.
    @property
    def ws_k(self) -> torch.Tensor | None:
        return self._ws_read(0)

    @ws_k.setter
    def ws_k(self, t: torch.Tensor | None) -> None:
        self._ws_store(0, t)

    @property
    def ws_v(self) -> torch.Tensor | None:
        return self._ws_read(1)

    @ws_v.setter
    def ws_v(self, t: torch.Tensor | None) -> None:
        self._ws_store(1, t)

    def _ws_store(self, slot: int, t: torch.Tensor | None) -> None:
        self._ws_plain[slot] = None
        if t is None:
            self._ws_code[slot] = None
        elif self.cfg.working_set_codec == "int8":  # this step reads the decoded copy made in passing
            codes, scale, self._ws_plain[slot] = page_code.encode_and_decode(t, self.dtype)
            self._ws_code[slot] = (codes, scale)
        else:
            self._ws_code[slot] = (t,)

    def _ws_read(self, slot: int) -> torch.Tensor | None:
        code = self._ws_code[slot]
        if code is None or len(code) == 1:
            return None if code is None else code[0]
        plain = self._ws_plain[slot]
        if plain is None:
            plain = self._ws_plain[slot] = page_code.decode(code[0], code[1], self.dtype)
        return plain

    def _ws_part(self, slot: int) -> Part:
        """The working set's keys (0) or values (1) for this step's attention: the decoded
        tensor where this step has one, else an int8 set's (codes, scale)."""
        code, plain = self._ws_code[slot], self._ws_plain[slot]
        assert code is not None
        if len(code) == 1:
            return code[0]
        return plain if plain is not None else (code[0], code[1])

    def _ws_bytes(self) -> int:
        return sum(tensor_bytes(t) for code in self._ws_code if code is not None for t in code)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stash the new K/V; attention appends them after it has read the tiers.

        Returns views tagged with this layer so the registered attention function
        can find the layer (it is not handed the cache). key_states: [b, h, q, d].
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise FlashMemError(
                f"layer {self.layer_idx}: the model did not run flashmem attention; "
                "use flashmem.attach(model, cfg) (it sets attn_implementation='tiered_kv')"
            )
        self._pending = (key_states, value_states)
        self.tokens_seen += key_states.shape[-2]
        k, v = key_states.view_as(key_states), value_states.view_as(value_states)
        k._flashmem_layer = self  # type: ignore[attr-defined]
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Attention reads only the new tokens' padding from the mask (the layer keeps the
        # validity of earlier tokens itself), so with `compact_mask` the mask covers just
        # them: [b, 1, q, q], not [b, 1, q, every position seen] (8 GB of booleans for an
        # 8K chunk at 1M tokens). A plain full layer sharing the model's mask needs every
        # position: the cache turns compact_mask off then.
        if self.compact_mask:
            return query_length, self.tokens_seen
        return self.tokens_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """A new sequence: block keys (layer, block) now name other blocks, so the
        prefetcher moves this layer to a fresh generation (nothing loaded for the old
        sequence is served to the new one) and shape-derived sizes are recomputed."""
        self.is_initialized = False
        self.tokens_seen = 0
        self._pending = None
        self._pf_block_bytes = None
        if self.prefetcher is not None:
            self.prefetcher.new_sequence(self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        raise FlashMemError("flashmem cache cannot be cropped (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise FlashMemError("flashmem cache does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise FlashMemError("flashmem cache does not support num_return_sequences > 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise FlashMemError("flashmem cache does not support batch selection")

    # -------------------------------------------------------------------- step
    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K/V `update` stashed for this forward ([b, h, q, d] each), once; None when
        there is none (the attention call is not one of this cache's steps)."""
        pending, self._pending = self._pending, None
        return pending

    def step(
        self,
        query: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        exact: bool = False,
    ) -> torch.Tensor:
        """One chunk of queries: attend over the tiers plus the chunk's own K/V (exact: over
        every earlier token, `exact_prompt`), then append the chunk. query: [b, Hq, m, d];
        k, v: [b, Hkv, m, d]; valid: [b, m] -> out [b, Hq, m, d]."""
        self.scaling = scaling
        group = query.shape[1] // k.shape[1]
        qg = _group_queries(query, group)
        if exact:
            out = self._attend_exact(query, k, v, valid, scaling)
        else:
            out = self._attend(query, qg, k, v, valid, scaling)
        self._ws_plain = [None, None]
        self.append(k, v, valid, qg, group)
        self.peak_resident_bytes = max(self.peak_resident_bytes, sum(self.resident_bytes().values()))
        return out

    def exact_prompt(self, q: int) -> bool:
        """Whether a forward of q new tokens attends every earlier token (prefill_exact_tokens):
        a prompt forward (q > 1; the prompt ends at the first one-token forward) while the
        context, with it, is within the cap. Otherwise the prompt's K/V is dropped for good:
        from here on every chunk attends its selection."""
        if not self._pre_open:
            return False
        n = self._valid_len
        if q > 1 and n + q <= self.cfg.prefill_exact_tokens and self._pre_len == n:
            self._pre_want = n + q
            return True
        self._pre_open = False
        self._pre_k = self._pre_v = None
        return False

    def resume_exact_prompt(self) -> None:
        """After a restored state (serve's prefix reuse): rebuild the prompt's K/V from the
        tiers (sinks, every sealed block from the cold tier, open block, window: every token
        in order), so an exact prompt goes on as a fresh prefill would. Nothing to do without
        an exact prompt or past its cap."""
        n = self._valid_len
        if not self._pre_open or n > self.cfg.prefill_exact_tokens or n == self._pre_len:
            return
        blocks = [self.fetch_block(j) for j in range(self.num_sealed)]
        k = torch.cat([self.sink_k, *(bk for bk, _ in blocks), self.open_k, self.win_k], dim=-2)
        v = torch.cat([self.sink_v, *(bv for _, bv in blocks), self.open_v, self.win_v], dim=-2)
        assert k.shape[-2] == n, "the tiers hold every token seen"
        self._pre_k, self._pre_v, self._pre_len = k.contiguous(), v.contiguous(), n

    def _attend_exact(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, valid_new: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """A prompt chunk q [b, Hq, m, d] over every earlier token and itself, causal, as the
        full cache attends -> [b, Hq, m, d]. The chunk joins the prompt's K/V first."""
        b, hkv, m, d = k_new.shape
        T = self._pre_len
        need = T + m
        if self._pre_k is None or self._pre_k.shape[-2] < need:
            # room for the whole forward (a prompt in one forward is allocated once); a prompt
            # fed in several forwards grows by doubling (O(n) copies), never past the cap
            old = 0 if self._pre_k is None else self._pre_k.shape[-2]
            size = max(need, self._pre_want, min(2 * old, self.cfg.prefill_exact_tokens))
            grown = [torch.empty(b, hkv, size, d, dtype=k_new.dtype, device=k_new.device) for _ in range(2)]
            if self._pre_k is not None and self._pre_v is not None:
                grown[0][:, :, :T] = self._pre_k[:, :, :T]
                grown[1][:, :, :T] = self._pre_v[:, :, :T]
            self._pre_k, self._pre_v = grown
        assert self._pre_k is not None and self._pre_v is not None
        self._pre_k[:, :, T:need] = k_new
        self._pre_v[:, :, T:need] = v_new
        self._pre_len = need
        valid = torch.cat([self.valid, valid_new], dim=-1)  # [b, T + m]
        allowed = torch.ones(m, need, dtype=torch.bool, device=q.device).tril(T)[None] & valid[:, None, :]
        allowed[:, :, T:] |= torch.eye(m, dtype=torch.bool, device=q.device)  # each sees itself
        mask = _step_scratch().take("mask", (b, 1, m, need), q.dtype, q.device)  # [b, 1, m, T + m]
        mask.zero_().masked_fill_(~allowed[:, None], -math.inf)
        K, V = self._pre_k[:, :, :need], self._pre_v[:, :, :need]
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] > hkv)

    def _scores(self, qg: torch.Tensor, scaling: float) -> torch.Tensor:
        """Index scores of every page for queries qg [b, h, nq, d] -> [b, h, nq, n_pages]."""
        summaries = self.hca_k[:, :, :, None] if self.scorer.uses_hca_entries else self.index.read(qg.dtype)
        return self.scorer.score(qg, summaries, scaling)

    def _select(
        self,
        scores: torch.Tensor,
        page_valid: torch.Tensor,
        k_sel: int,
        scaling: float,
        qg: torch.Tensor | None = None,
        page_tokens_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Top `k_sel` pages (blocks unless `lsa_page_tokens`) per KV head from index
        scores [b, h, nq, n_pages]; page_valid: [b, n_pages] -> page ids [b, h, k] sorted.

        With `lsa_rerank` r > 1 (and qg [b, h, nq, d], page_tokens_valid [b, n_pages, P]
        given) the index picks r * k_sel candidates (at least `lsa_rerank_min_pages`) and
        their exact keys pick the k_sel.
        """
        cfg = self.cfg
        n_cand = k_sel
        if qg is not None and page_tokens_valid is not None:
            n_cand = max(k_sel * cfg.lsa_rerank, cfg.lsa_rerank_min_pages)
        n_pages = scores.shape[-1]
        n_cand = min(n_cand, n_pages)
        idx = None
        if n_cand > k_sel and n_cand == n_pages:  # every page a candidate: no index stage
            assert qg is not None and page_tokens_valid is not None
            idx = self._rerank_in_place(qg, page_tokens_valid, k_sel, scaling)
        if idx is None:
            idx = select_blocks(
                scores,
                page_valid,
                n_cand,
                scaling,
                follow=cfg.lsa_follow_pages,
                pool=cfg.lsa_pool,
                share_heads=cfg.lsa_share_heads,
            )
            if n_cand > k_sel:
                assert qg is not None and page_tokens_valid is not None
                ranked = None
                if IN_PLACE_CANDIDATES * n_cand >= n_pages:
                    ranked = self._rerank_in_place(qg, page_tokens_valid, k_sel, scaling, idx)
                idx = self._rerank(idx, qg, page_tokens_valid, k_sel, scaling) if ranked is None else ranked
        if self.selection_hook is not None:
            idx = self.selection_hook(self.layer_idx, idx, scores)
        return idx

    def _rerank(
        self, cand: torch.Tensor, qg: torch.Tensor, page_tokens_valid: torch.Tensor, k_sel: int, scaling: float
    ) -> torch.Tensor:
        """The k_sel of the candidate pages cand [b, h, c] (sorted) with the most exact
        attention mass for queries qg [b, h, nq, d] -> page ids [b, h, k_sel] sorted.
        The candidates' K/V are kept for this step only (`_cand`): the working set is
        cut from them, not read again."""
        cfg = self.cfg
        b, h, c = cand.shape
        ck, cv = self._read_candidates(cand)  # [b, h, c, P, d]; cv None: read for the winners only
        bi = torch.arange(b, device=cand.device)[:, None, None]
        cvalid = page_tokens_valid[bi, cand]  # [b, h, c, P]
        mass = exact_page_mass(qg, ck, cvalid, scaling, cfg.lsa_pool, cfg.lsa_share_heads)  # [b, h, c]
        n_pages = page_tokens_valid.shape[1]
        dense = torch.full((b, h, n_pages), -1.0, device=cand.device).scatter(-1, cand, mass)
        allowed = torch.zeros(b, h, n_pages, dtype=torch.bool, device=cand.device).scatter(-1, cand, True)
        allowed &= page_tokens_valid.any(-1)[:, None, :]
        idx = top_pages(dense, allowed, k_sel, cfg.lsa_follow_pages)
        self._cand = (cand, ck, cv)
        return idx

    def _rerank_in_place(
        self,
        qg: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        k_sel: int,
        scaling: float,
        cand: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """_rerank with the keys read where the store holds them (`block_keys`: one batched
        matmul over every block, no copy into page order) -> page ids [b, h, k_sel] sorted;
        candidates cand [b, h, c] (None: every page) by masking the others' tokens, the
        same softmax over the candidates. None where the store cannot hand keys over so
        (another device than the arena's, a prefetcher, coded or latent blocks)."""
        cfg = self.cfg
        if self.prefetcher is not None or self.latent is not None:
            return None
        t0 = time.perf_counter()
        block_k = self.store.block_keys(self.layer_idx, self.num_sealed, self.device)
        if block_k is None:
            return None
        counts = self.fetch_counts
        if counts is not None:  # every block's keys are read: counted as _arena_pages counts reads
            counts["misses"] += self.num_sealed
            counts["stall_s"] += time.perf_counter() - t0
        b, n_pages, P = page_tokens_valid.shape
        allowed = page_tokens_valid.any(-1)[:, None, :]  # [b, 1, pages]
        valid = page_tokens_valid[:, None]  # [b, 1, pages, P]
        if cand is not None:
            h = cand.shape[1]
            chosen = torch.zeros(b, h, n_pages, dtype=torch.bool, device=cand.device).scatter_(-1, cand, True)
            allowed = allowed & chosen
            valid = valid & chosen[..., None]
        mass = exact_block_mass(
            qg, block_k, valid.flatten(-2), P, scaling, cfg.lsa_pool, cfg.lsa_share_heads
        )  # [b, h, pages]
        return top_pages(mass, allowed, k_sel, cfg.lsa_follow_pages)

    def _take_candidates(self) -> torch.Tensor | None:
        """This step's re-rank candidates [b, h, c] (None without), dropping their K/V."""
        cand, self._cand = self._cand, None
        return None if cand is None else cand[0]

    def _read_candidates(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Exact keys of pages idx [b, h, c] -> k [b, h, c, P, d] and v: from the memory
        store's arena only the keys (v None: the winners' values are read after), else
        both, cut from whole blocks read once each."""
        got = self._arena_pages(idx, values=False)
        if got is not None:
            assert got[0] is not None
            return got[0], None
        return self._pages_of_blocks(idx, torch.unique(idx // self.cfg.pages_per_block))

    def _pages_of_blocks(
        self, idx: torch.Tensor, need: torch.Tensor, only: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the blocks `need` (sorted ids) once each and cut pages idx [b, h, k] out of
        them -> k, v [b, h, k, P, d] (pages of blocks not in `need`: arbitrary rows); with
        `only` [b, h, k] bool just those pages, flat [n, P, d]."""
        ppb = self.cfg.pages_per_block
        need_ids = need.tolist()
        if self.prefetcher is not None and self.demand_batch:
            # Queue every block this step needs before waiting for the first: the loader
            # threads then read them in parallel (already ready or in flight: skipped).
            self.prefetcher.request([(self.layer_idx, j) for j in need_ids], urgent=True)
        blocks = [self.fetch_block(j) for j in need_ids]
        pool_k = torch.stack([bk for bk, _ in blocks])  # [u, b, h, B, d]
        pool_v = torch.stack([bv for _, bv in blocks])
        slot = torch.searchsorted(need, idx // ppb).clamp_max(len(need_ids) - 1)  # [b, h, k]
        return cut_pages(pool_k, slot, idx % ppb, ppb, only), cut_pages(pool_v, slot, idx % ppb, ppb, only)

    def _attend(
        self,
        q: torch.Tensor,
        qg: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        valid_new: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """One chunk: q [b, Hq, m, d] over the tiers plus its own K/V -> [b, Hq, m, d]."""
        cfg = self.cfg
        b, hkv, m, d = k_new.shape
        neg = float("-inf")
        keys: list[Part] = []
        values: list[Part] = []
        biases: list[torch.Tensor] = []
        rest: tuple[torch.Tensor, torch.Tensor] | None = None  # the rest entry: value, logit

        def add(k: Part, v: Part, bias: torch.Tensor) -> None:
            n = _part_len(k)
            if n:
                keys.append(k)
                values.append(v)
                biases.append(bias.expand(b, hkv, n))  # every bias is [b, h or 1, n]

        def from_valid(valid: torch.Tensor) -> torch.Tensor:  # [b, L] -> [b, 1, L]
            return torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill(~valid, neg)[:, None]

        S = self.sink_k.shape[-2]
        add(self.sink_k, self.sink_v, from_valid(self.valid[:, :S]))
        window = cfg.position_mode == "window"
        shown = 0  # tokens of selected pages attended (their positions in window mode)

        n = self.num_sealed
        if n > 0:
            ppb = cfg.pages_per_block
            page_tokens_valid = self.block_valid_tokens().reshape(b, n * ppb, cfg.page_tokens)  # [b, pages, P]
            k_sel = cfg.blocks_to_select(n * ppb)
            selected = torch.zeros(b, hkv, n * ppb, dtype=torch.bool, device=q.device)  # per page
            page_valid = page_tokens_valid.any(-1)  # [b, pages]
            # The rest entry needs every query's scores; a selection pools them, so a sample will do.
            q_index = qg if cfg.keeps_rest_entry else _sample_queries(qg, m, cfg.lsa_prefill_queries)
            scores = self._scores(q_index, scaling) if k_sel > 0 or cfg.keeps_rest_entry else None
            self._cand = None  # never a previous step's (one that raised, or before a reset)
            if k_sel > 0:
                assert scores is not None
                positions = q_index.shape[2] * m // qg.shape[2]  # query positions scoring the index
                rerank = cfg.lsa_rerank > 1 and positions <= RERANK_MAX_QUERIES
                ctx = (q_index, page_tokens_valid) if rerank else (None, None)
                idx = self._select(scores, page_valid, k_sel, scaling, *ctx)  # [b, h, k] page ids
                selected.scatter_(-1, idx, True)
                self._gather_working_set(idx, page_tokens_valid)
                # prefetch for the next step (re-ranked: the candidates, which it reads again)
                cand = self._take_candidates()
                self.look_ahead((idx if cand is None else cand) // ppb)
            else:
                self.ws_idx = self.ws_k = self.ws_v = self.ws_valid = None
            # Far blocks (out of the near band) are represented by their HCA entry, unless a
            # page of theirs is attended exactly (the entry stands for the whole block).
            touched = selected.view(b, hkv, n, ppb).any(-1)
            band_start = n - len(self.csa_blocks)
            far = torch.arange(n, device=q.device) < band_start
            if cfg.use_summaries:
                add(self.hca_k, self.hca_v, _entry_bias(self.hca_cnt, far & ~touched, cfg.summary_bias, q.dtype))
            if cfg.use_summaries and self.csa_k.shape[-2]:
                ids = self.csa_page_ids.expand(b, hkv, -1)
                use = ~selected.gather(-1, ids)
                add(self.csa_k, self.csa_v, _entry_bias(self.csa_cnt, use, cfg.summary_bias, q.dtype))
            if k_sel > 0:
                assert self.ws_valid is not None
                # int8: (codes, scale), decoded straight into the keys attention reads (_concat)
                ws_k, ws_v = self._ws_part(0), self._ws_part(1)
                if window:  # selected page j's tokens move to S + j*P .., right after the sinks
                    plain_k = self.ws_k
                    assert plain_k is not None and self.ws_idx is not None
                    P = cfg.page_tokens
                    true = S + self.ws_idx[..., None] * P + torch.arange(P, device=q.device)  # [b, h, k, P]
                    moved = S + torch.arange(true[0, 0].numel(), device=q.device)
                    ws_k = self._rope().rotate(plain_k, moved - true.flatten(-2))
                    shown = k_sel * P
                add(ws_k, ws_v, torch.zeros_like(self.ws_valid, dtype=q.dtype).masked_fill(~self.ws_valid, neg))
            if cfg.keeps_rest_entry:
                assert scores is not None
                rest = self._rest_entry(scores, selected, page_tokens_valid, k_sel > 0, scaling, m)

        o0 = S + n * cfg.hca_chunk_size
        o1 = o0 + self.open_k.shape[-2]
        w1 = o1 + self.win_k.shape[-2]
        open_k, win_k = self.open_k, self.win_k
        # window: the open block, window and new tokens follow the selected pages (a shift
        # of every one of them by the same amount, queries included, keeps their relative positions)
        shift = S + shown - o0 if window else 0
        if shift:
            rope = self._rope()
            delta = torch.tensor(float(shift), device=q.device)
            open_k, win_k = rope.rotate(open_k, delta), rope.rotate(win_k, delta)
            q, k_new = rope.rotate(q, delta), rope.rotate(k_new, delta)
        add(open_k, self.open_v, from_valid(self.valid[:, o0:o1]))
        add(win_k, self.win_v, from_valid(self.valid[:, o1:w1]))

        # New tokens: causal among themselves, padding hidden; each sees itself so no row is empty.
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        allowed = (causal[None] & valid_new[:, None, :]) | torch.eye(m, dtype=torch.bool, device=q.device)[None]
        new_bias = torch.zeros(b, 1, m, m, dtype=q.dtype, device=q.device).masked_fill(~allowed[:, None], neg)

        keys.append(k_new)
        values.append(v_new)
        group = q.shape[1] // hkv
        dev = k_new.device
        # The mask [b, Hq, m, L] is written into a reused buffer laid out [b, h, group, m, L]
        # (query head h * group + g, as enable_gqa pairs them): a prefill chunk's mask is
        # 100+ MB per layer, and a fresh one each time costs its page faults.
        L = sum(bias.shape[-1] for bias in biases) + m + (rest is not None)
        scratch = _step_scratch()
        mask = scratch.take("mask", (b, hkv, group, m, L), q.dtype, dev)
        at = 0
        for bias in biases:  # [b, h, n]: one row for every query
            n = bias.shape[-1]
            mask[..., at : at + n] = bias[:, :, None, None, :]
            at += n
        mask[..., at : at + m] = new_bias[:, :, None]  # [b, 1, 1, m, m]
        if rest is not None:  # a zero key: its logit is all bias, per query head and query
            v_rest, logit = rest
            keys.append(torch.zeros_like(v_rest, dtype=k_new.dtype))
            values.append(v_rest.to(v_new.dtype))
            mask[..., -1] = logit.view(b, hkv, group, m)
        mask = mask.view(b, hkv * group, m, L)
        K = _concat(keys, lambda shape: scratch.take("keys", shape, k_new.dtype, dev))
        V = _concat(values, lambda shape: scratch.take("values", shape, v_new.dtype, dev))
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scaling, enable_gqa=group > 1)

    def _rest_entry(
        self,
        scores: torch.Tensor,
        selected: torch.Tensor,
        page_tokens_valid: torch.Tensor,
        has_ws: bool,
        scaling: float,
        m: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One entry per KV head standing for every sealed token not attended exactly,
        so the softmax keeps the mass the left-out history had (without it, attention
        renormalises over a few pages and the output leaves the model's range).

        Logit, per query: log sum over left-out pages of n_page * exp(s q . index key);
        value: the mean value of the left-out tokens (running sum minus the selected
        pages'). scores: [b, h, m*group, pages]; selected: [b, h, pages];
        page_tokens_valid: [b, pages, P] -> value [b, h, 1, d], logit [b, Hq, m].
        """
        b, h, nq, _ = scores.shape
        group = nq // m
        counts = page_tokens_valid.sum(-1).to(torch.float32)  # [b, pages]
        left = ~selected & (counts > 0)[:, None, :]
        lg = scores.float() * scaling + counts.clamp_min(1).log()[:, None, None, :]
        logit = torch.logsumexp(lg.masked_fill(~left[:, :, None, :], float("-inf")), dim=-1)  # [b, h, nq]
        logit = logit.view(b, h, m, group).transpose(2, 3).reshape(b, h * group, m)
        v_sum, n_left = self.v_sum, counts.sum(-1)[:, None].expand(b, h)
        if has_ws:
            assert self.ws_v is not None and self.ws_valid is not None
            w = self.ws_valid.to(torch.float32)
            v_sum = v_sum - (self.ws_v.float() * w[..., None]).sum(-2)
            n_left = n_left - w.sum(-1)
        v_rest = v_sum / n_left.clamp_min(1)[..., None]
        return v_rest[:, :, None, :], logit

    def _rope(self) -> RopeRotator:
        assert self.rope is not None  # checked in __init__ for position_mode: window
        return self.rope

    def _gather_working_set(self, idx: torch.Tensor, page_tokens_valid: torch.Tensor) -> None:
        """Bring the selected pages' exact K/V to the device. idx: [b, h, k] page ids, sorted;
        page_tokens_valid: [b, n_pages, P]. Read directly from a memory store, the pages
        come from its arena in one op; otherwise the cold tier hands out whole blocks:
        each needed block is read once and its selected pages are cut out of it.

        Reused as is when the selection did not change since the last step.
        """
        prev = self.ws_idx
        if prev is not None and prev.shape == idx.shape and torch.equal(prev, idx):
            return
        kept = self._held_over(idx)  # int8: pages the last working set holds, kept coded
        if self._cand is not None and self._cut_from_candidates(idx, page_tokens_valid, kept):
            return
        if self.prefetcher is None and self._gather_pages_directly(idx, page_tokens_valid, kept):
            return
        P, ppb = self.cfg.page_tokens, self.cfg.pages_per_block
        if kept is not None:  # int8: read and code only the blocks of the pages not held
            new = ~kept[0]
            need = torch.unique(idx[new] // ppb)
            if need.numel():
                k_new, v_new = self._pages_of_blocks(idx, need, only=new)
            else:
                k_new = v_new = self._no_pages()
            self._merge_working_set(idx, kept, k_new, v_new, page_tokens_valid)
            return
        b, h, _ = idx.shape
        bi = torch.arange(b, device=idx.device)[:, None, None]
        hi = torch.arange(h, device=idx.device)[None, :, None]
        # A (row, head) keeps the pages it already holds; only the rest is fetched.
        if prev is not None and prev.shape[:2] == idx.shape[:2]:
            match = idx[..., :, None] == prev[..., None, :]  # [b, h, k, k_prev]
            held = match.any(-1)
            src = match.to(torch.int8).argmax(-1)
        else:
            held = torch.zeros_like(idx, dtype=torch.bool)
            src = torch.zeros_like(idx)
        need = torch.unique(idx[~held] // ppb)  # blocks to read
        if need.numel():
            new_k, new_v = self._pages_of_blocks(idx, need)
        if held.any():
            assert self.ws_k is not None and self.ws_v is not None  # held: a previous working set exists
            d = self.ws_k.shape[-1]
            old_k = self.ws_k.view(b, h, -1, P, d)[bi, hi, src]  # [b, h, k, P, d]
            old_v = self.ws_v.view(b, h, -1, P, d)[bi, hi, src]
            if need.numel():
                keep = held[..., None, None]
                new_k, new_v = torch.where(keep, old_k, new_k), torch.where(keep, old_v, new_v)
            else:
                new_k, new_v = old_k, old_v
        self._set_working_set(idx, new_k, new_v, page_tokens_valid)

    def _held_over(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For an int8 working set: which of the pages idx [b, h, k] the last step's working
        set holds (held [b, h, k] bool) and where (src [b, h, k], its page slot), so only the
        others are read and coded (a page's codes depend on its tokens alone: the same as
        coding it again). None: nothing to keep (another codec, no working set, other rows,
        or a low-rank cold tier read directly: its pages decode at their [b, h, k] places)."""
        prev, code = self.ws_idx, self._ws_code[0]
        if prev is None or code is None or len(code) != 2 or prev.shape[:2] != idx.shape[:2] or not prev.shape[-1]:
            return None
        if self.latent is not None and self.prefetcher is None:
            return None
        src = torch.searchsorted(prev.contiguous(), idx.contiguous()).clamp_max_(prev.shape[-1] - 1)  # both sorted
        held = prev.gather(-1, src) == idx
        return (held, src) if bool(held.any()) else None

    def _cut_from_candidates(
        self, idx: torch.Tensor, page_tokens_valid: torch.Tensor, held: tuple[torch.Tensor, torch.Tensor] | None
    ) -> bool:
        """The working set cut from this step's re-rank candidates (`_rerank`), which
        hold every page idx [b, h, k] names unless a selection hook replaced them.
        held: `_held_over`'s pages, not cut again."""
        assert self._cand is not None
        cand, ck, cv = self._cand
        pos = torch.searchsorted(cand, idx).clamp_max(cand.shape[-1] - 1)
        if not torch.equal(cand.gather(-1, pos), idx):
            return False
        b, h, k = idx.shape
        c, P, d = ck.shape[2:]
        bi = torch.arange(b, device=idx.device)[:, None, None]
        hi = torch.arange(h, device=idx.device)[None, :, None]
        rows = ((bi * h + hi) * c + pos).reshape(-1)  # page rows of [b*h*c, P*d]
        new = None if held is None else ~held[0]
        if new is not None:
            rows = rows[new.reshape(-1)]

        def cut(t: torch.Tensor) -> torch.Tensor:
            out = t.reshape(-1, P * d).index_select(0, rows)
            return out.view(-1, P, d) if new is not None else out.view(b, h, k, P, d)

        if cv is not None:
            v = cut(cv)
        elif new is not None and not bool(new.any()):
            v = self._no_pages()
        else:
            got = self._arena_pages(idx, keys=False, only=new)
            if got is None or got[1] is None:
                return False
            v = got[1]
        if held is None:
            self._set_working_set(idx, cut(ck), v, page_tokens_valid)
        else:
            self._merge_working_set(idx, held, cut(ck), v, page_tokens_valid)
        return True

    def _gather_pages_directly(
        self, idx: torch.Tensor, page_tokens_valid: torch.Tensor, held: tuple[torch.Tensor, torch.Tensor] | None
    ) -> bool:
        """Without a prefetcher, a store that can cut pages out of many blocks at once
        (MemoryStore's arena) hands over just the selected pages: one indexing op,
        no whole blocks stacked. idx: [b, h, k] page ids; held: `_held_over`'s pages, not
        read again. False: the store cannot."""
        if held is not None and not bool((~held[0]).any()):
            self._merge_working_set(idx, held, self._no_pages(), self._no_pages(), page_tokens_valid)
            return True
        got = self._arena_pages(idx, only=None if held is None else ~held[0])
        if got is None:
            return False
        assert got[0] is not None and got[1] is not None
        if held is None:
            self._set_working_set(idx, got[0], got[1], page_tokens_valid)
        else:
            self._merge_working_set(idx, held, got[0], got[1], page_tokens_valid)
        return True

    def _arena_pages(
        self, idx: torch.Tensor, keys: bool = True, values: bool = True, only: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """Pages idx [b, h, k] from the store's `gather_pages` (k, v [b, h, k, P, d], a part
        not asked for None; with `only` [b, h, k] bool just those, flat [n, P, d]), counted
        as synchronous reads (one per block touched, as fetch_block counts); None without a
        prefetcher-free path or when the store declines."""
        if self.prefetcher is not None:
            return None
        ppb = self.cfg.pages_per_block
        lat = self.latent
        if lat is not None and only is not None:  # latent pages decode by their [b, h, k] positions
            return None
        slots = (keys, values) if lat is None else lat.slots(keys, values)  # store slots holding them
        t0 = time.perf_counter()
        got = self.store.gather_pages(self.layer_idx, idx // ppb, idx % ppb, ppb, self.device, *slots, only=only)
        counts = self.fetch_counts
        if got is not None and counts is not None:
            counts["misses"] += int(torch.unique(idx // ppb if only is None else (idx // ppb)[only]).numel())
            counts["stall_s"] += time.perf_counter() - t0
        if got is not None and lat is not None:  # coefficients -> K/V, keys rotated at their positions
            got = lat.decode_pages(got[0], got[1], idx, self.block_start, keys, values)
        return got

    def _set_working_set(
        self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_tokens_valid: torch.Tensor
    ) -> None:
        """idx [b, h, k] pages with their K/V [b, h, k, P, d] become the working set."""
        b, h, _ = idx.shape
        d = k.shape[-1]
        self.ws_k = k.reshape(b, h, -1, d)
        self.ws_v = v.reshape(b, h, -1, d)
        self.ws_valid = page_tokens_valid[torch.arange(b, device=idx.device)[:, None, None], idx].reshape(b, h, -1)
        self.ws_idx = idx

    def _no_pages(self) -> torch.Tensor:
        """The K or V of no pages, [0, P, d] (every page held over)."""
        code = self._ws_code[0]
        assert code is not None
        return code[0].new_empty(0, self.cfg.page_tokens, code[0].shape[-1], dtype=self.dtype)

    def _merge_working_set(
        self,
        idx: torch.Tensor,
        held: tuple[torch.Tensor, torch.Tensor],
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        page_tokens_valid: torch.Tensor,
    ) -> None:
        """An int8 working set of pages idx [b, h, k]: the pages `held` ([b, h, k] bool, src
        slots) keep their codes from the last step's; the others' K/V k_new, v_new
        [n_new, P, d] (in (b, h, k) order) are coded now."""
        keep, src = held
        b, h, k = idx.shape
        assert self.ws_idx is not None
        rows_prev = b * h * self.ws_idx.shape[-1]
        bi = torch.arange(b, device=idx.device)[:, None, None]
        hi = torch.arange(h, device=idx.device)[None, :, None]
        flat = keep.reshape(-1)
        # each page's row in [last working set's pages; new pages] (one index_select: index_copy_
        # into a fresh tensor measured 30-50x slower on CPU, benchmarks/micro_decode_parts.py)
        old_rows = ((bi * h + hi) * self.ws_idx.shape[-1] + src).reshape(-1)
        pick = torch.where(flat, old_rows, rows_prev + (~flat).cumsum(0) - 1)
        P = self.cfg.page_tokens
        for slot, fresh in ((0, k_new), (1, v_new)):
            code = self._ws_code[slot]
            assert code is not None and len(code) == 2
            codes, scale = code
            d = codes.shape[-1]
            new_c, new_s = page_code.encode(fresh)  # [n_new, P, d], [n_new, P, 1]
            out_c = torch.cat([codes.view(-1, P * d), new_c.view(-1, P * d)]).index_select(0, pick)
            out_s = torch.cat([scale.view(-1, P), new_s.view(-1, P)]).index_select(0, pick)
            self._ws_code[slot] = (out_c.view(b, h, k * P, d), out_s.view(b, h, k * P, 1))
            self._ws_plain[slot] = None  # decoded on this step's first read
        self.ws_valid = page_tokens_valid[bi, idx].reshape(b, h, -1)
        self.ws_idx = idx

    # ------------------------------------------------------------------- tiers
    @property
    def num_sealed(self) -> int:
        return self.sealed

    @property
    def block_start(self) -> int:
        return self.sink_k.shape[-2]

    def block_valid_tokens(self) -> torch.Tensor:
        """[b, n, B] validity of every sealed block's tokens."""
        B, n, s = self.cfg.hca_chunk_size, self.num_sealed, self.block_start
        return self.valid[:, s : s + n * B].reshape(self.valid.shape[0], n, B)

    @property
    def valid(self) -> torch.Tensor:
        """[b, tokens seen] True where a position holds a real token (not padding)."""
        return self._valid_buf[:, : self._valid_len]

    @valid.setter
    def valid(self, value: torch.Tensor) -> None:  # a restored state (serve/state.py)
        self._valid_buf = value.clone()
        self._valid_len = value.shape[-1]

    def _append_valid(self, valid: torch.Tensor) -> None:
        n, m = self._valid_len, valid.shape[-1]
        if n + m > self._valid_buf.shape[-1]:
            grown = torch.zeros(
                valid.shape[0], max(2 * self._valid_buf.shape[-1], n + m), dtype=torch.bool, device=valid.device
            )
            grown[:, :n] = self._valid_buf[:, :n]
            self._valid_buf = grown
        self._valid_buf[:, n : n + m] = valid
        self._valid_len = n + m

    def append(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, queries: torch.Tensor, group: int) -> None:
        """Add new tokens after attention. k, v: [b, h, q, d]; valid: [b, q];
        queries: [b, h, q*group, d], token-major (a GQA group's queries per KV head)."""
        cfg = self.cfg
        self._append_valid(valid)
        if cfg.use_summaries:  # the fusion rule reads them; nothing else does
            self.recent_q = _keep_last(self.recent_q, queries, RECENT_QUERY_TOKENS * group)
        take = min(cfg.sink_tokens - self.sink_k.shape[-2], k.shape[-2])
        if take > 0:
            self.sink_k = torch.cat([self.sink_k, k[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, v[:, :, :take]], dim=-2)
            k, v = k[:, :, take:], v[:, :, take:]
        if k.shape[-2] == 0:
            return
        win_k = torch.cat([self.win_k, k], dim=-2)
        win_v = torch.cat([self.win_v, v], dim=-2)
        over = win_k.shape[-2] - cfg.gpu_cache_limit
        if over > 0:
            self.open_k = torch.cat([self.open_k, win_k[:, :, :over]], dim=-2)
            self.open_v = torch.cat([self.open_v, win_v[:, :, :over]], dim=-2)
            win_k, win_v = win_k[:, :, over:], win_v[:, :, over:]
        self.win_k, self.win_v = win_k, win_v
        B = cfg.hca_chunk_size
        nb = self.open_k.shape[-2] // B
        if nb > 0:
            failure = self._seal(self.open_k[:, :, : nb * B], self.open_v[:, :, : nb * B])
            self.open_k = self.open_k[:, :, nb * B :]
            self.open_v = self.open_v[:, :, nb * B :]
            if failure is not None:
                raise failure  # reported once every tier of the layer is consistent again

    def _seal(self, k: torch.Tensor, v: torch.Tensor) -> ColdStoreError | None:
        """Seal nb full blocks. k, v: [b, h, nb*B, d], the oldest unsealed history.

        All-or-nothing: a store that reports a write error from `put` has kept the
        block (readable from memory), so the seal completes and the error is returned
        for the caller to raise once the layer's tiers agree again."""
        cfg = self.cfg
        B, c = cfg.hca_chunk_size, cfg.csa_chunk_size
        b, h, T, d = k.shape
        nb = T // B
        first = self.num_sealed
        start = self.block_start + first * B
        pos = torch.arange(start, start + T, device=k.device)
        valid = self.valid[:, start : start + T]
        per = cfg.csa_per_block
        band_blocks = cfg.csa_band_blocks if cfg.use_summaries else 0
        if cfg.keeps_hca_entries:
            ctx = FusionContext(self.recent_q, self.scaling)
            logimp = self.rule.log_importance(k, ctx)  # [b, h, T]
            hca = fuse_chunks(k, v, logimp, valid, pos, B, self.rotator)
            self.hca_k = torch.cat([self.hca_k, hca.keys], dim=-2)
            self.hca_v = torch.cat([self.hca_v, hca.values], dim=-2)
            self.hca_cnt = torch.cat([self.hca_cnt, hca.counts], dim=-1)
            if band_blocks > 0:
                csa = fuse_chunks(k, v, logimp, valid, pos, c, self.rotator)
        self.sealed += nb
        self.index.extend(self._summarize_pages(k, valid))
        if cfg.keeps_rest_entry:
            self.v_sum += (v.float() * valid[:, None, :, None].to(torch.float32)).sum(-2)
        failure: ColdStoreError | None = None
        # the cold tier's form of the blocks: exact, or low-rank coefficients [b, h, T, width]
        ck, cv = (k, v) if self.latent is None else self.latent.encode(k, v, pos)
        for j in range(nb):
            kj, vj = ck[:, :, j * B : (j + 1) * B], cv[:, :, j * B : (j + 1) * B]
            try:
                self.store.put((self.layer_idx, first + j), kj, vj)
            except ColdStoreError as exc:  # the store kept the block; raised once the layer is consistent
                failure = failure or exc
            if band_blocks > 0:
                sl = slice(j * per, (j + 1) * per)
                self.csa_blocks.append((first + j, csa.keys[:, :, sl], csa.values[:, :, sl], csa.counts[:, sl]))
        while len(self.csa_blocks) > band_blocks:
            self.csa_blocks.popleft()  # aged out of the near band: only the HCA entry stays
        self._rebuild_band()
        return failure

    def _summarize_pages(self, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Index summaries of every page of new blocks: k [b, h, T, d], valid [b, T]
        -> [b, h, T // P, vectors, d]. Pages go through the scorer as one batch."""
        b, h, T, d = k.shape
        P = self.cfg.page_tokens
        m = T // P
        pages = k.view(b, h, m, P, d).transpose(1, 2).reshape(b * m, h, P, d)
        summ = self.scorer.summarize(pages, valid.reshape(b * m, P))  # [b*m, h, vectors, d]
        return summ.view(b, m, h, *summ.shape[2:]).transpose(1, 2)

    def _rebuild_band(self) -> None:
        blocks = list(self.csa_blocks)
        dev = self.hca_k.device
        if not blocks:
            self.csa_k = self.csa_v = self.hca_k[:, :, :0]
            self.csa_cnt = self.hca_cnt[:, :0]
            self.csa_page_ids = torch.zeros(0, dtype=torch.long, device=dev)
            return
        self.csa_k = torch.cat([blk[1] for blk in blocks], dim=-2)
        self.csa_v = torch.cat([blk[2] for blk in blocks], dim=-2)
        self.csa_cnt = torch.cat([blk[3] for blk in blocks], dim=-1)
        cfg = self.cfg
        per = cfg.csa_per_block
        ids = torch.tensor([blk[0] for blk in blocks], dtype=torch.long, device=dev)
        # The page each CSA entry lies in (pages are whole multiples of CSA chunks).
        within = torch.arange(per, device=dev) * cfg.csa_chunk_size // cfg.page_tokens
        self.csa_page_ids = (ids[:, None] * cfg.pages_per_block + within[None]).reshape(-1)

    def fetch_block(self, block_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact (or codec-decoded) K/V of a sealed block, on this layer's device. [b, h, B, d] each.

        Through the Prefetcher when there is one (a hit when look-ahead loaded it
        already; otherwise a miss whose wait is stall time), else a synchronous
        store read, counted as a miss and stall.
        """
        key = (self.layer_idx, int(block_idx))
        pf = self.prefetcher
        if pf is not None:
            out = pf.get(key, self.device)
        else:
            t0 = time.perf_counter()
            out = self.store.get(key, self.device)
            counts = self.fetch_counts
            if counts is not None:
                counts["misses"] += 1
                counts["stall_s"] += time.perf_counter() - t0
        if self.latent is not None:  # coefficients -> K/V, keys rotated at their positions
            out = self.latent.decode_block(*out, self.block_start + int(block_idx) * self.cfg.hca_chunk_size)
        return out

    def look_ahead(self, idx: torch.Tensor) -> None:
        """Look-ahead (docs/design.md): queue background loads of the blocks predicted for the next
        step (this step's selection idx [b, h, k] and neighbours within prefetch_window)."""
        pf = self.prefetcher
        if pf is None:
            return
        cfg = self.cfg
        cap = None
        if self.lookahead_bytes is not None:
            cap = max(1, self.lookahead_bytes // self._prefetch_block_bytes())
        blocks = predict_next_blocks(idx, self.num_sealed, cfg.hca_chunk_size, cfg.prefetch_window, max_blocks=cap)
        pf.request([(self.layer_idx, j) for j in blocks])

    def _prefetch_block_bytes(self) -> int:
        """Bytes one block takes in the prefetch buffer (coded when the store hands out payloads)."""
        n = self._pf_block_bytes
        if n is None:
            b, h, _, d = self.sink_k.shape
            if self.latent is not None:
                d = self.latent.width  # the store's slots hold low-rank coefficients
            shape = (b, h, self.cfg.hca_chunk_size, d)
            if self.store.coded_reads:
                n = int(self.store.codec.nbytes(shape, self.dtype))
            else:
                n = 2 * b * h * self.cfg.hca_chunk_size * d * self.sink_k.element_size()
            self._pf_block_bytes = n = max(1, n)
        return n

    # ---------------------------------------------------------------- memory
    def resident_bytes(self) -> dict[str, int]:
        """Bytes of every device-resident tensor of this layer, per tier."""
        nb = tensor_bytes
        return {
            "sinks": nb(self.sink_k) + nb(self.sink_v),
            "window": nb(self.win_k) + nb(self.win_v),
            "open_block": nb(self.open_k) + nb(self.open_v),
            "csa_entries": nb(self.csa_k) + nb(self.csa_v),
            "hca_entries": nb(self.hca_k) + nb(self.hca_v),
            "index": self.index.nbytes(),
            "working_set": self._ws_bytes(),
            "query_buffer": nb(self.recent_q),
            "rest_entry": nb(self.v_sum),
            "prefill_kv": nb(self._pre_k) + nb(self._pre_v),
        }


def _step_scratch() -> Scratch:
    """The buffers a step's attention is assembled in: the thread's, reused. Under autograd
    (a forward outside torch.no_grad) fresh ones: a buffer written again by the next layer
    would change what backward reads."""
    return Scratch() if torch.is_grad_enabled() else thread_scratch()


def _part_len(p: Part) -> int:
    return (p[0] if isinstance(p, tuple) else p).shape[-2]


def _concat(parts: list[Part], buffer: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """Attention's keys or values: parts [b, h, n_i, d] -> [b, h, sum n_i, d], written into
    `buffer(shape)` (a reused scratch buffer). An int8 part (codes, scale [b, h, n, 1]) is
    decoded into its place in the same pass, not decoded and then copied."""
    if len(parts) == 1 and isinstance(parts[0], torch.Tensor):
        return parts[0]
    if torch.is_grad_enabled():  # autograd refuses out= writes: decode, then concatenate
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        return torch.cat([p if isinstance(p, torch.Tensor) else page_code.decode(p[0], p[1], dtype) for p in parts], -2)
    lead = parts[0][0] if isinstance(parts[0], tuple) else parts[0]
    b, h, _, d = lead.shape
    out = buffer((b, h, sum(_part_len(p) for p in parts), d))
    at = 0
    for p in parts:
        n = _part_len(p)
        if isinstance(p, tuple):
            torch.mul(p[0], p[1], out=out[:, :, at : at + n])
        else:
            out[:, :, at : at + n] = p
        at += n
    return out


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes a tensor holds (0 for an absent one)."""
    return 0 if t is None else t.nbytes


def _keep_last(old: torch.Tensor | None, new: torch.Tensor, n: int) -> torch.Tensor:
    """Last n rows (dim -2) of old ++ new: the most recent query positions."""
    both = new if old is None else torch.cat([old, new], dim=-2)
    return both[:, :, -n:].clone() if both.shape[-2] > n else both


def _group_queries(q: torch.Tensor, group: int) -> torch.Tensor:
    """[b, Hq, m, d] -> [b, Hkv, m*group, d], token-major, each KV head's GQA group."""
    b, hq, m, d = q.shape
    return q.view(b, hq // group, group, m, d).transpose(2, 3).reshape(b, hq // group, m * group, d)


def _sample_queries(qg: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """n evenly spaced of a chunk's m query positions, the last included, each with its
    whole GQA group: [b, h, m*group, d] -> [b, h, n*group, d]; all of them when n is 0 or >= m."""
    if n <= 0 or m <= n:
        return qg
    group = qg.shape[2] // m
    pos = (m - 1 - torch.arange(n, device=qg.device) * m // n).flip(0)  # distinct: m > n
    rows = (pos[:, None] * group + torch.arange(group, device=qg.device)).reshape(-1)
    return qg.index_select(2, rows)


def _entry_bias(counts: torch.Tensor, use: torch.Tensor, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """Additive logit bias of fused entries. counts: [b, n]; use: [b, h, n] or [n] -> [b, h, n].

    `log_size` gives an entry standing for s tokens log(s) extra logit (proportional
    attention, as in token merging), so it can carry the mass of the tokens it replaces.
    """
    c = counts[:, None, :].to(torch.float32)
    bias = c.clamp_min(1).log() if rule == "log_size" else torch.zeros_like(c)
    keep = use & (counts[:, None, :] > 0)
    return bias.masked_fill(~keep, float("-inf")).to(dtype)
