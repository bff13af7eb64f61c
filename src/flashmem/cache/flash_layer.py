"""One managed attention layer: its tiers and its step.

Step (docs/design.md, "Data flow"), per chunk of queries: rank the sealed pages
with the chunk's queries (`ranking.py`), bring the chosen ones to the device (the
working set, `working_set.py`, read through `block_reads.py`), attend once over
sinks | HCA entries of unselected far blocks | CSA entries of unselected near
blocks | selected pages | open block | window | new tokens, causal
(`assembly.py`), then append the new tokens to the tiers. A prompt within
`prefill_exact_tokens` attends every earlier token instead (`exact_prompt.py`).

Token flow ("append"): the first `sink_tokens` tokens become sinks; later ones
enter the window; tokens pushed out of the window fill the open block; a full
open block is sealed: its CSA entries, HCA entry and index summary are computed,
and its exact K/V go to the cold store. The newest `csa_band_tokens // B` sealed
blocks keep their CSA entries resident.

The open block and the window are held as one tensor (open | window) while appends are all
that change them: an append is one cat per K and V, and a token leaving the window for the
open block moves the boundary between them, not its bytes. `open_k`, `win_k`, .. are views
of it; setting one (a crop, a restored state, a static segment's end, a row reorder) keeps
the four apart until the next append joins them again.

Positions are implicit and exact: sinks hold 0..S-1, sealed block j holds
S + j*B .. S + (j+1)*B - 1, then the open block, then the window. With
`position_mode: window` attention sees other ones (the stored keys keep their
real rotation): selected pages are re-rotated to S, S+1, .. in order, and the
open block, window, new keys and the queries are shifted to follow them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from flashmem.cache import generation, layer_state
from flashmem.cache.block_reads import BlockReader
from flashmem.cache.exact_prompt import ExactPrompt, attend_streamed
from flashmem.cache.page_codes import PageCodes
from flashmem.cache.ranking import CandidateRanker, SelectionHook
from flashmem.cache.static_step import StaticStep
from flashmem.cache.summaries import SummaryTiers
from flashmem.cache.tiered_attention import attend, group_queries
from flashmem.cache.traffic import Traffic
from flashmem.cache.validity import Validity
from flashmem.cache.working_set import WorkingSet
from flashmem.compress.fusion import FusionRule
from flashmem.config import FlashMemoryConfig
from flashmem.errors import ColdStoreError, ConfigError, FlashMemError
from flashmem.index.base import BlockScorer
from flashmem.index.vectors import IndexVectors, summarize_pages
from flashmem.rope import RopeRotator
from flashmem.store.base import ColdStore
from flashmem.store.memory import MemoryStore
from flashmem.store.prefetch import Prefetcher

if TYPE_CHECKING:
    from flashmem.cache.guard import StepGuard
    from flashmem.cache.latent import LatentKV

__all__ = ["FlashLayer", "SelectionHook", "tensor_bytes"]


class FlashLayer(CacheLayerMixin):
    """Cache layer whose attention runs through `flashmem.cache.attention`, which
    calls `take_pending` and then `step` per chunk of queries."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # crop(-n): the exact tail, then sealed blocks unsealed (cache/generation.py)
    selection_hook: SelectionHook | None = None
    # The cache's StepGuard (None for a layer used alone): told when a step fails half-way.
    guard: StepGuard | None = None
    # Masks span the new tokens only (see get_mask_sizes); the cache clears it when a plain
    # full layer reads the same mask.
    compact_mask: bool = True
    # Set by flashmem.prefill while it feeds a chunk that is not the prompt's end: the
    # chunk's tail is not the prompt's tail, so it does not select on its own.
    mid_prompt: bool = False
    # A memory store on the CPU is read directly, not through the prefetcher (see
    # lazy_initialization); tests of the prefetcher over a memory store turn this off.
    read_memory_directly: bool = True

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
        traffic: Traffic | None = None,
    ) -> None:
        """prefetcher, fetch_counts, lookahead_bytes, traffic: see `BlockReader`."""
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
        self.reader = BlockReader(
            layer_idx,
            cfg,
            store,
            prefetcher=prefetcher,
            fetch_counts=fetch_counts,
            lookahead_bytes=lookahead_bytes,
            traffic=traffic,
        )
        self.tokens_seen = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scaling = 1.0  # the model's attention scale, set by each step (fusion reads it)
        self.peak_resident_bytes = 0
        self.decoding = False  # a one-token forward (or a crop) has run: the prompt is over
        self.exact_redo = False  # this forward attends every earlier token exactly (cache/doubt.py)
        self.forward_exact = False  # the last forward did (an exact prompt, or a redo)

    # The cold tier's read path lives in self.reader; these name its switches.
    prefetcher = property(lambda self: self.reader.prefetcher, lambda self, pf: setattr(self.reader, "prefetcher", pf))
    latent: LatentKV | None = property(  # type: ignore[assignment]
        lambda self: self.reader.latent, lambda self, lat: setattr(self.reader, "latent", lat)
    )
    demand_batch = property(
        lambda self: self.reader.demand_batch, lambda self, on: setattr(self.reader, "demand_batch", on)
    )
    lookahead_bytes = property(lambda self: self.reader.lookahead_bytes)
    fetch_block = property(lambda self: self.reader.fetch_block)

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
        self._join(empty(0), empty(0), 0)
        self.sealed = 0
        self.summaries = SummaryTiers(self.cfg, self.rule, self.rotator, empty(0))
        width = self.scorer.width or d
        self.index = IndexVectors(b, h, self.scorer.vectors, width, self.cfg.lsa_index_dtype, dt, dev)
        # Sum of every sealed token's value [b, h, d] (fp32): the rest entry's value is
        # this minus the selected pages' values, over the tokens left out (empty without it).
        rest_d = d if self.cfg.keeps_rest_entry else 0
        self.v_sum = torch.zeros(b, h, rest_d, dtype=torch.float32, device=dev)
        self.validity = Validity(b, dev)  # which positions seen are real tokens
        self.reader.bind((b, h, d), dev, dt, self.cfg.sink_tokens)
        self.ranker = CandidateRanker(self.layer_idx, self.cfg, self.scorer, self.reader, self.index)
        self.working_set = WorkingSet(
            self.cfg.working_set_codec,
            self.cfg.page_tokens,
            dt,
            self.cfg.lsa_cache_pages,
            in_place=self.cfg.position_mode != "window",  # window mode shows the pages in their order
        )
        self.working_set.kv_bytes = self.reader.decode_kv_bytes()
        # streamed from the tiers when the cold tier gives exact blocks back, else held
        streamed = self.cfg.cold_codec == "exact" and self.cfg.cold_low_rank == "none"
        self.exact = ExactPrompt(self.cfg.prefill_exact_tokens, streamed)
        self.static: StaticStep | None = None  # decode_step: static's current segment
        self.page_codes: PageCodes | None = None  # its int8 pages, coded on the host
        self.static_steps = 0  # decode steps it ran (memory_report()["static_decode_steps"])
        # decode_step graph: its segments' CUDA graphs captured, replayed and failed to capture
        self.graph_counts = {"captures": 0, "replays": 0, "failures": 0}
        self.is_initialized = True

    # ---------------------------------------------------------- open block and window
    # Joined: _rk, _rv [b, h, open + window, d] with the first _open_n tokens the open block's,
    # and _views their four views, made when first read. Apart: _apart holds the four tensors.
    _rk: torch.Tensor | None = None
    _rv: torch.Tensor | None = None
    _open_n = 0
    _views: dict[str, torch.Tensor] | None = None
    _apart: dict[str, torch.Tensor] | None = None

    def _join(self, rk: torch.Tensor, rv: torch.Tensor, open_n: int) -> None:
        self._rk, self._rv, self._open_n = rk, rv, open_n
        self._views = self._apart = None

    def _tail(self, name: str) -> torch.Tensor:
        if self._rk is None:
            assert self._apart is not None
            return self._apart[name]
        views = self._views
        if views is None:  # the same view objects until the tiers change (StaticStep.serves compares them)
            o, rk, rv = self._open_n, self._rk, self._rv
            assert rv is not None
            views = self._views = {
                "open_k": rk[:, :, :o],
                "open_v": rv[:, :, :o],
                "win_k": rk[:, :, o:],
                "win_v": rv[:, :, o:],
            }
        return views[name]

    def _set_tail(self, name: str, value: torch.Tensor) -> None:
        if self._rk is not None:
            self._apart = {n: self._tail(n) for n in ("open_k", "open_v", "win_k", "win_v")}
            self._rk = self._rv = self._views = None
        assert self._apart is not None
        self._apart[name] = value

    # [b, h, n, d] each: the open block's tokens, then the window's (the newest)
    open_k = property(lambda self: self._tail("open_k"), lambda self, t: self._set_tail("open_k", t))
    open_v = property(lambda self: self._tail("open_v"), lambda self, t: self._set_tail("open_v", t))
    win_k = property(lambda self: self._tail("win_k"), lambda self, t: self._set_tail("win_k", t))
    win_v = property(lambda self: self._tail("win_v"), lambda self, t: self._set_tail("win_v", t))

    def tail_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The open block and the window in order, as few tensors as they are held in:
        ([K], [V]) joined, ([open K, window K], [open V, window V]) apart."""
        if self._rk is not None:
            assert self._rv is not None
            return [self._rk], [self._rv]
        return [self.open_k, self.win_k], [self.open_v, self.win_v]

    def _open_count(self) -> int:
        return self._open_n if self._rk is not None else self.open_k.shape[-2]

    def _tail_bytes(self) -> tuple[int, int]:
        """(open block, window) bytes, K and V, without making views."""
        if self._rk is None:
            nb = tensor_bytes
            return nb(self.open_k) + nb(self.open_v), nb(self.win_k) + nb(self.win_v)
        assert self._rv is not None
        both, n = self._rk.nbytes + self._rv.nbytes, self._rk.shape[-2]
        opened = both * self._open_n // n if n else 0
        return opened, both - opened

    # The working set's page ids [b, h, k], K/V [b, h, k*P, d] (model dtype) and validity.
    ws_idx = property(lambda self: self.working_set.idx)
    ws_k = property(lambda self: self.working_set.k)
    ws_v = property(lambda self: self.working_set.v)
    ws_valid = property(lambda self: self.working_set.valid)

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
        self.decoding = False
        if self.prefetcher is not None:
            self.prefetcher.new_sequence(self.layer_idx)

    # generate()'s features (cache/generation.py): crop (assisted and prompt-lookup decoding),
    # unsealing the newest blocks where the exact tail is too short, and row changes with a
    # shared cold tier.
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest -tokens_to_remove tokens: from the window and the open block, and
        past them from sealed blocks brought back from the cold tier (an exact one), as if they
        had never come; a crop the layer cannot make is one FlashMemError."""
        generation.crop(self, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row r is old row beam_idx[r]."""
        generation.select_rows(self, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        generation.repeat(self, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        generation.select(self, indices)

    # ------------------------------------------------------------ server state
    def state_mark(self) -> layer_state.LayerMark:
        """Where the append-only parts end now (the next `export_state` starts here)."""
        return layer_state.mark(self)

    def export_state(self, since: layer_state.LayerMark) -> dict[str, torch.Tensor]:
        """What the layer gained since `since` plus its tail now (CPU tensors by name)."""
        return layer_state.export(self, since)

    def load_state(self, records: list[dict[str, torch.Tensor]]) -> None:
        """Rebuild the state after the last of `export_state`'s records (in order)."""
        layer_state.load(self, records)

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
        qg = group_queries(query, group)
        static = None if exact else self._static_step(k.shape[-2])
        if exact and self.exact.streamed:
            out = attend_streamed(self, query, k, v, valid, scaling)
            tiers = self.resident_bytes()
            read = tiers["sinks"] + tiers["open_block"] + tiers["window"] + 2 * k.nbytes
        elif exact:
            out = self.exact.attend(query, k, v, torch.cat([self.valid, valid], dim=-1), scaling)
            read = self.exact.read_bytes()
        elif static is not None:
            out = static.run(query, qg, k, v, valid, scaling)  # attends and appends the chunk
            self.static_steps += 1
            read = self.attended_bytes() + 2 * k.nbytes
        else:
            out = attend(self, query, qg, k, v, valid, scaling)
            read = self.attended_bytes() + 2 * k.nbytes
        self.finish_step(read, k, v, valid, qg, group, append=static is None)
        return out

    def finish_step(
        self,
        read: int,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
        qg: torch.Tensor,
        group: int,
        append: bool = True,
    ) -> None:
        """After a chunk's attention (`step`, or a batch's shared attention): count the device
        bytes it read, drop the step's decoded working set, append the chunk (unless a static
        segment did) and keep the peak. k, v: [b, h, m, d]; valid: [b, m]; qg: [b, h, m*group, d]."""
        self.reader.traffic.add("device_read_bytes", read)
        self.working_set.end_step()
        if append:
            self.append(k, v, valid, qg, group)
        self.peak_resident_bytes = max(self.peak_resident_bytes, sum(self.resident_bytes().values()))

    def _static_step(self, m: int) -> StaticStep | None:
        """The segment a decode step runs in with `decode_step: static` or `graph` (a new one when
        the last ended or the layer changed under it), or None: this step runs eagerly."""
        if self.cfg.decode_step == "eager" or m != 1:
            return None
        if self.static is None or not self.static.serves(self):
            self.static = StaticStep(self) if StaticStep.applies(self) else None
        return self.static

    def exact_prompt(self, q: int) -> bool:
        """Whether a forward of q new tokens attends every earlier token (prefill_exact_tokens):
        a prompt forward (q > 1; the prompt ends at the first one-token forward) while the
        context, with it, is within the cap. Otherwise the prompt's K/V is dropped for good:
        from here on every chunk attends its selection."""
        return self.exact.admits(q, self.validity.length)

    def resume_exact_prompt(self) -> None:
        """After a restored state (serve's prefix reuse): rebuild the prompt's K/V from the
        tiers (sinks, every sealed block from the cold tier, open block, window: every token
        in order), so an exact prompt goes on as a fresh prefill would."""

        def every_token() -> tuple[torch.Tensor, torch.Tensor]:
            blocks = [self.fetch_block(j) for j in range(self.num_sealed)]
            k = torch.cat([self.sink_k, *(bk for bk, _ in blocks), self.open_k, self.win_k], dim=-2)
            v = torch.cat([self.sink_v, *(bv for _, bv in blocks), self.open_v, self.win_v], dim=-2)
            return k, v

        self.exact.resume(self.validity.length, every_token)

    def attended_bytes(self) -> int:
        """Device-resident bytes a selecting step reads (every tier but the query buffer and
        an exact prompt's K/V)."""
        tiers = self.resident_bytes()
        return sum(n for name, n in tiers.items() if name not in ("query_buffer", "prefill_kv"))

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
        return self.validity.view

    @valid.setter
    def valid(self, value: torch.Tensor) -> None:  # a restored state (layer_state.load)
        self.validity.set(value)

    def append(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, queries: torch.Tensor, group: int) -> None:
        """Add new tokens after attention. k, v: [b, h, q, d]; valid: [b, q];
        queries: [b, h, q*group, d], token-major (a GQA group's queries per KV head)."""
        cfg = self.cfg
        self.validity.append(valid)
        self.summaries.note_queries(queries, group)
        take = min(cfg.sink_tokens - self.sink_k.shape[-2], k.shape[-2])
        if take > 0:
            self.sink_k = torch.cat([self.sink_k, k[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, v[:, :, :take]], dim=-2)
            k, v = k[:, :, take:], v[:, :, take:]
        if k.shape[-2] == 0:
            return
        opened = self._open_count()
        ks, vs = self.tail_parts()
        rk, rv = torch.cat([*ks, k], dim=-2), torch.cat([*vs, v], dim=-2)
        # what the window cannot hold joins the open block: the boundary moves
        self._join(rk, rv, max(opened, rk.shape[-2] - cfg.gpu_cache_limit))
        self.seal_full_blocks()

    def seal_full_blocks(self) -> None:
        """Seal the open block's full blocks (after an append, or a crop that unsealed blocks)."""
        B = self.cfg.hca_chunk_size
        opened = self._open_count()
        nb = opened // B
        if nb > 0:
            failure = self._seal(self.open_k[:, :, : nb * B], self.open_v[:, :, : nb * B])
            # what stays is copied out of the tensor it was cut from: a view would keep the whole
            # appended chunk's K/V alive (a prompt chunk's, every layer, until its next append)
            if self._rk is not None:
                assert self._rv is not None
                self._join(_own(self._rk[:, :, nb * B :]), _own(self._rv[:, :, nb * B :]), opened - nb * B)
            else:
                self.open_k = _own(self.open_k[:, :, nb * B :])
                self.open_v = _own(self.open_v[:, :, nb * B :])
            if failure is not None:
                raise failure  # reported once every tier of the layer is consistent again

    def _seal(self, k: torch.Tensor, v: torch.Tensor) -> ColdStoreError | None:
        """Seal nb full blocks. k, v: [b, h, nb*B, d], the oldest unsealed history.

        All-or-nothing: a store that reports a write error from `put` has kept the
        block (readable from memory), so the seal completes and the error is returned
        for the caller to raise once the layer's tiers agree again."""
        cfg = self.cfg
        B = cfg.hca_chunk_size
        T = k.shape[-2]
        first = self.num_sealed
        start = self.block_start + first * B
        pos = torch.arange(start, start + T, device=k.device)
        valid = self.valid[:, start : start + T]
        self.summaries.seal(k, v, valid, pos, first, self.scaling)
        self.sealed += T // B
        self.index.extend(summarize_pages(self.scorer, k, valid, self.cfg.page_tokens))
        if self.ranker.codes is not None:  # lsa_rerank_codec: coded while the keys are at hand
            self.ranker.codes.extend(k)
        if cfg.keeps_rest_entry:
            self.v_sum += (v.float() * valid[:, None, :, None].to(torch.float32)).sum(-2)
        failure: ColdStoreError | None = None
        # the cold tier's form of the blocks: exact, or low-rank coefficients [b, h, T, width]
        ck, cv = (k, v) if self.latent is None else self.latent.encode(k, v, pos)
        for j in range(T // B):
            try:
                self.store.put(
                    (self.layer_idx, first + j), ck[:, :, j * B : (j + 1) * B], cv[:, :, j * B : (j + 1) * B]
                )
            except ColdStoreError as exc:  # the store kept the block; raised once the layer is consistent
                failure = failure or exc
        return failure

    # ---------------------------------------------------------------- memory
    def resident_bytes(self) -> dict[str, int]:
        """Bytes of every device-resident tensor of this layer, per tier."""
        nb = tensor_bytes
        open_block, window = self._tail_bytes()
        if self.static is not None and self.static.serves(self):
            # a static segment holds the open block's whole room from its start (one buffer of
            # window + block), and its attention bias and slot ids beside it
            open_block = self.static.recent.nbytes - window + self.static.bookkeeping_bytes()
        return {
            "sinks": nb(self.sink_k) + nb(self.sink_v),
            "window": window,
            "open_block": open_block,
            **self.summaries.nbytes(),
            # the block index, and the re-rank's candidate codes when held on the device
            "index": self.index.nbytes() + self.ranker.device_nbytes(),
            "working_set": self.working_set.nbytes(),
            "rest_entry": nb(self.v_sum),
            "prefill_kv": self.exact.nbytes(),
        }


def _own(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where t is a view of a larger tensor (the copy frees the rest)."""
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes a tensor holds (0 for an absent one)."""
    return 0 if t is None else t.nbytes
