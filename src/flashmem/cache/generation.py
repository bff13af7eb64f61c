"""generate() features on a FlashLayer: crop (assisted and prompt-lookup decoding) and
changes of the batch rows (beam search, num_return_sequences, batch selection).

Crop. Assisted decoding runs the target over a draft and then removes the tokens it
rejected (`Cache.crop(-n)`). A FlashLayer keeps the newest tokens resident and exact:
the window (the last `gpu_cache_limit` tokens), the open block, and, while nothing is
sealed, the sinks. A crop leaves the tiers a layer that never saw the removed tokens
would hold: the blocks the kept tokens would not have sealed (a draft that sealed
blocks, or a crop longer than the window and the open block) are unsealed first, their
K/V read back from the cold tier into the open block (`unseal`: every per-block state
drops them, what held their pages starts over); then the newest tokens are cut off the
end, the window is refilled from the open block, and what the kept tokens fill seals
again. Unsealing needs the blocks as they came: an exact cold tier, and rows that read
their own stored rows (`unseal_refusal`); otherwise a crop takes only the window and the
open block (a draft that sealed a block then leaves the accepted tokens in it and the
window short: the same tokens in the same order) and one that reaches further is refused
with one line. `FlashMemoryCache.crop` checks every layer and reads every layer's blocks
before any layer changes. The cold tier keeps an unsealed block's old bytes until its id
seals again (`put` replaces them); nothing reads a block past `sealed`.
Also cut: the validity of positions and tokens_seen. A crop (even of 0 tokens) ends an
exact prompt (`end_exact_prompt`): the prompt and the first draft attend exactly, the
later verify forwards select for each token, as decode steps do. Not undone: the fusion
rule's recent queries (`use_summaries` only) keep the rejected tokens' queries, so the HCA
entries of blocks sealed again may differ from a fresh layer's; and the near band holds no
CSA entries for unsealed blocks' predecessors that had aged out of it, until more blocks seal.

Rows. Beam search reorders rows after every step (`reorder_cache(beam_idx)`), and
`batch_repeat_interleave` / `batch_select_indices` repeat or drop them: each is
"new row r is old row src[r]" (`select_rows`). Every device tensor of the layer is
indexed on its batch dim. The cold tier is not copied: a sealed block never changes
and the store holds all of its rows, so the rows stay shared and each layer keeps a
row map [sealed blocks, rows] -> the stored row a row reads (`RowMap`); successive
changes compose (map[:, src]), and blocks sealed later are stored in the new row order
(an identity map). Reads of a mapped block go through `RowMappedStore` /
`RowMappedPrefetcher`, which pick the rows of each block read (`index_select`, one copy
of the block, as any read makes); the paths that cut pages out of many blocks at once
(a memory store's arena: `gather_pages`, `block_keys`, `block_run`) decline while a
non-identity map is in force, and the reader falls back to whole blocks. Copy-on-write
is then unnecessary: a diverging beam writes its own new blocks, and the old blocks'
rows it shares are never written again.

Shapes: layer tensors [b, h, n, d]; a row map [n_mapped_blocks, b] (long); src [b_new].
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, cast

import torch

from flashmem.errors import FlashMemError
from flashmem.store.base import ColdStore

if TYPE_CHECKING:
    from flashmem.cache.flash_layer import FlashLayer
    from flashmem.store.base import BlockKey
    from flashmem.store.prefetch import Prefetcher

__all__ = [
    "RowMap",
    "Unsealed",
    "blocks_to_unseal",
    "crop",
    "croppable_tokens",
    "crop_count",
    "read_unsealed",
    "repeat",
    "select",
    "select_rows",
    "unseal",
    "unseal_refusal",
]


# ---------------------------------------------------------------------------- crop
def crop_count(tokens_to_remove: int) -> int:
    """Tokens a `crop(tokens_to_remove)` removes: transformers passes -n to remove n (0:
    nothing). A positive value (the legacy "keep this many") is refused, as DynamicLayer does."""
    if tokens_to_remove > 0:
        raise FlashMemError(
            f"crop({tokens_to_remove}): a positive count is not allowed; allowed: crop(-n) to remove the last n tokens"
        )
    return -tokens_to_remove


def croppable_tokens(layer: FlashLayer) -> int:
    """How many of the newest tokens a crop can remove: the window and the open block, and,
    where sealed blocks can be unsealed (`unseal_refusal`), every sealed block and then the
    sinks (while no block is sealed the sinks are exact and resident: removable)."""
    if not layer.is_initialized:
        return 0
    tail = layer.win_k.shape[-2] + layer.open_k.shape[-2]
    if layer.sealed == 0:
        return tail + layer.sink_k.shape[-2]
    if unseal_refusal(layer) is not None:
        return tail
    return tail + layer.sealed * layer.cfg.hca_chunk_size + layer.sink_k.shape[-2]


def unseal_refusal(layer: FlashLayer) -> str | None:
    """Why this layer's sealed blocks cannot be given back to a crop, or None. Unsealing reads a
    block's K/V back from the cold tier into the open block: only an exact cold tier gives
    back the tokens that were sealed, and only while every row reads its own stored row."""
    cfg = layer.cfg
    if cfg.cold_codec != "exact":
        return f"cold_codec: {cfg.cold_codec} keeps sealed blocks coded, not as they came"
    if layer.latent is not None:
        return f"cold_low_rank: {cfg.cold_low_rank} keeps sealed blocks as low-rank coefficients"
    if isinstance(layer.reader.store, RowMappedStore):
        return "the rows changed (beam search) since blocks were sealed"
    return None


def blocks_to_unseal(layer: FlashLayer, n: int) -> int:
    """Sealed blocks a crop of n tokens unseals: those the kept tokens would not have sealed (a
    layer that saw them alone holds its last `gpu_cache_limit` in the window and seals full
    blocks of the rest), so the crop leaves the tiers of a layer that never saw the removed
    tokens. 0 where blocks cannot be unsealed (`unseal_refusal`): the crop then takes the
    newest tokens from the window and the open block only, and the window stays short."""
    if not layer.is_initialized or layer.sealed == 0 or unseal_refusal(layer) is not None:
        return 0
    cfg = layer.cfg
    kept = layer.tokens_seen - n
    middle = kept - layer.sink_k.shape[-2] - cfg.gpu_cache_limit  # what the window pushed out
    return max(0, layer.sealed - max(0, middle) // cfg.hca_chunk_size)


def check_crop(layer: FlashLayer, n: int) -> None:
    """Raise one line unless the layer can remove its newest n tokens now."""
    if layer._pending is not None:
        raise FlashMemError(
            f"layer {layer.layer_idx}: crop in the middle of a forward; allowed: crop between model forwards"
        )
    room = croppable_tokens(layer)
    if n <= room:
        return
    why = unseal_refusal(layer) if layer.sealed else None
    if why is not None:
        raise FlashMemError(
            f"crop of {n} tokens reaches into sealed history (layer {layer.layer_idx} holds its last {room} "
            f"exact, and cannot unseal blocks: {why}); allowed: at most {room} (the window keeps the last "
            f"gpu_cache_limit={layer.cfg.gpu_cache_limit} tokens croppable)"
        )
    raise FlashMemError(
        f"crop of {n} tokens is more than layer {layer.layer_idx} holds ({room}); allowed: at most {room}"
    )


# The newest sealed blocks' K/V as the cold tier gives them back, oldest first: [(k, v) [b, h, B, d]].
Unsealed = list[tuple[torch.Tensor, torch.Tensor]]


def read_unsealed(layer: FlashLayer, n: int) -> Unsealed | None:
    """The sealed blocks a crop of n tokens unseals (`blocks_to_unseal`), read from the cold tier
    (checksummed there) before anything changes, or None (none)."""
    u = blocks_to_unseal(layer, n)
    if u == 0:
        return None
    return [layer.reader.fetch_block(j) for j in range(layer.sealed - u, layer.sealed)]


def unseal(layer: FlashLayer, blocks: Unsealed) -> None:
    """The newest len(blocks) sealed blocks, read back, become the start of the open block again
    (one copy, with the open block's tokens): every per-block state drops them (summaries, index
    pages, re-rank codes, the rest entry's value sum) and what held their pages starts over
    (working set, page cache, candidates' codes, a static segment, the prefetcher's loaded
    blocks). Until the crop seals again, the open block holds their tokens too: a transient of
    the blocks a draft sealed. The cold tier keeps their old bytes until the same block ids seal
    again (`put` replaces them); nothing reads a block past `sealed`."""
    cfg = layer.cfg
    B, ppb, S = cfg.hca_chunk_size, cfg.pages_per_block, layer.block_start
    cut = layer.sealed - len(blocks)
    if cfg.keeps_rest_entry:
        for j, (_, bv) in enumerate(blocks, start=cut):
            valid = layer.valid[:, S + j * B : S + (j + 1) * B].to(torch.float32)  # [b, B]
            layer.v_sum -= (bv.float() * valid[:, None, :, None]).sum(-2)
    summ = layer.summaries
    summ.hca_k, summ.hca_v, summ.hca_cnt = summ.hca_k[:, :, :cut], summ.hca_v[:, :, :cut], summ.hca_cnt[:, :cut]
    summ.csa_blocks = deque(blk for blk in summ.csa_blocks if blk[0] < cut)
    summ.rebuild_band()
    index = layer.index
    index.codes = index.codes[:, :, : cut * ppb]
    if index.scales is not None:
        index.scales = index.scales[:, :, : cut * ppb]
    ranker = layer.ranker
    if ranker.codes is not None:  # re-rank codes or the key copy: coded again as the blocks seal
        ranker.codes.n = min(ranker.codes.n, cut)
    if ranker.device_codes is not None:
        ranker.device_codes.clear()
    ranker._last_cand = ranker._last_all = None
    pv = ranker.page_values
    if pv is not None and pv.blocks > cut:
        pv.means, pv.blocks = pv.means[:, :, : cut * ppb], cut
    layer.working_set.clear()
    layer.static = None
    layer.page_codes = None
    if layer.prefetcher is not None:  # blocks loaded ahead under these ids are the old ones
        layer.prefetcher.new_sequence(layer.layer_idx)
    layer.sealed = cut
    layer.open_k = torch.cat([*(bk for bk, _ in blocks), layer.open_k], dim=-2)
    layer.open_v = torch.cat([*(bv for _, bv in blocks), layer.open_v], dim=-2)


def crop(layer: FlashLayer, tokens_to_remove: int, unsealed: Unsealed | None = None) -> None:
    """`CacheLayerMixin.crop`: remove the newest tokens (see the module docstring). unsealed: the
    blocks `read_unsealed` read for this crop ahead of time (FlashMemoryCache.crop reads every
    layer's before it changes any), else read here."""
    if not layer.is_initialized:
        return
    n = crop_count(tokens_to_remove)
    if n:
        check_crop(layer, n)
    end_exact_prompt(layer)
    if n == 0:
        return
    if unsealed is None:
        unsealed = read_unsealed(layer, n)
    if unsealed is not None:
        unseal(layer, unsealed)
    for name in ("win", "open", "sink"):
        k, v = getattr(layer, f"{name}_k"), getattr(layer, f"{name}_v")
        take = min(n, k.shape[-2])
        if take:
            setattr(layer, f"{name}_k", k[:, :, : k.shape[-2] - take])
            setattr(layer, f"{name}_v", v[:, :, : v.shape[-2] - take])
            n -= take
    # Refill the window from the open block's tail: what it held before the draft pushed it.
    gap = min(layer.cfg.gpu_cache_limit - layer.win_k.shape[-2], layer.open_k.shape[-2])
    if gap > 0:
        cut = layer.open_k.shape[-2] - gap
        layer.win_k = torch.cat([layer.open_k[:, :, cut:], layer.win_k], dim=-2)
        layer.win_v = torch.cat([layer.open_v[:, :, cut:], layer.win_v], dim=-2)
        layer.open_k, layer.open_v = layer.open_k[:, :, :cut], layer.open_v[:, :, :cut]
    removed = -tokens_to_remove
    layer.tokens_seen -= removed
    layer.validity.drop_last(removed)
    if unsealed is not None:
        layer.seal_full_blocks()  # what the accepted tokens fill seals again, as an append would


def end_exact_prompt(layer: FlashLayer) -> None:
    """A crop means the model is verifying drafts: decoding has begun, so the exact prompt
    (`prefill_exact_tokens`) ends as at a one-token forward. Verify forwards carry several
    tokens and there may never be a one-token forward: kept open, every one of them would
    attend the whole context exactly (streamed: the cold tier read again per forward;
    buffered: the prompt's K/V held on the device, growing with every accepted token). The
    verify forwards after it select per token (`select_per_token_max`), as decode steps do."""
    layer.decoding = True
    exact = layer.exact
    exact.open = False
    exact.k = exact.v = None


# ---------------------------------------------------------------------------- rows
class RowMap:
    """For each block sealed before the last row change: which stored row each current row
    reads ([n, b] long), and how many rows it was stored with (stored [n]). Blocks from `n`
    on are stored in the current row order."""

    def __init__(self, rows: torch.Tensor, owner: object, stored: torch.Tensor) -> None:
        self.rows = rows
        self.stored = stored
        # The layer's index object when the map was made: a reset layer builds a new one,
        # and its blocks are stored in its own row order (the map no longer applies).
        self.owner = owner
        # every block read as stored: the fast paths (arena, in-place keys) stay open. Not when
        # rows were dropped: [0] of blocks stored with 2 rows reads a part of each block
        b = rows.shape[1]
        same = bool((stored == b).all()) and bool((rows == torch.arange(b, device=rows.device)).all())
        self.identity = rows.numel() == 0 or same

    @property
    def blocks(self) -> int:
        return self.rows.shape[0]

    def rows_of(self, block: int) -> torch.Tensor | None:
        """Stored rows of `block` for the current rows, or None (stored as they are)."""
        return self.rows[block] if 0 <= block < self.blocks else None


def _map_of(layer: FlashLayer) -> RowMap | None:
    store = layer.reader.store
    if isinstance(store, RowMappedStore) and store.map.owner is layer.index:
        return store.map
    return None


class RowMappedStore:
    """A layer's view of the shared cold store through its row map (reads only; puts and
    everything else go to the store as they are)."""

    def __init__(self, inner: ColdStore, layer_idx: int, row_map: RowMap, layer: FlashLayer) -> None:
        self.inner, self.layer_idx, self.map, self._layer = inner, layer_idx, row_map, layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _live(self) -> RowMap | None:
        m = self.map
        return m if m.owner is self._layer.index and not m.identity else None

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _pick(self._live(), key, self.inner.get(key, device))

    @property
    def page_reads(self) -> bool:
        return self._live() is None and bool(self.inner.page_reads)

    def gather_pages(self, *args: Any, **kwargs: Any) -> Any:
        return None if self._live() is not None else self.inner.gather_pages(*args, **kwargs)

    def block_keys(self, layer_idx: int, n: int, device: torch.device | str) -> torch.Tensor | None:
        return None if self._live() is not None else self.inner.block_keys(layer_idx, n, device)

    def block_run(self, layer_idx: int, start: int, stop: int) -> Any:
        return None if self._live() is not None else self.inner.block_run(layer_idx, start, stop)


class RowMappedPrefetcher:
    """The prefetcher as the layer reads it: each block handed out in the layer's row order."""

    def __init__(self, inner: Prefetcher, store: RowMappedStore) -> None:
        self.inner, self.store = inner, store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _pick(self.store._live(), key, self.inner.get(key, device))


def _pick(m: RowMap | None, key: BlockKey, kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = None if m is None else m.rows_of(int(key[1]))
    if rows is None:
        return kv
    k, v = kv
    return k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device))


def _remap_cold(layer: FlashLayer, src: torch.Tensor, b_old: int) -> None:
    """Compose the layer's row map with src (the layer had b_old rows) and route its reads
    through it."""
    old = _map_of(layer)
    n = layer.sealed
    dev = src.device
    if old is None:
        rows = src.expand(n, -1)
        stored = torch.full((n,), b_old, dtype=torch.long)
    else:
        fresh = src.expand(n - old.blocks, -1)  # sealed since the last change: stored in that row order
        rows = torch.cat([old.rows.index_select(1, src), fresh])
        stored = torch.cat([old.stored, torch.full((n - old.blocks,), b_old, dtype=torch.long)])
    row_map = RowMap(rows.to(dev).contiguous(), layer.index, stored)
    reader = layer.reader
    inner = reader.store.inner if isinstance(reader.store, RowMappedStore) else reader.store
    view = RowMappedStore(inner, layer.layer_idx, row_map, layer)
    reader.store = cast(ColdStore, view)
    route_reads(layer)


def route_reads(layer: FlashLayer) -> None:
    """Send the layer's prefetcher reads through its row map, if it has one (after a row
    change, or after `FlashMemoryCache.use_prefetcher` handed it the cache's prefetcher)."""
    reader = layer.reader
    view, pf = reader.store, reader.prefetcher
    if pf is None or not isinstance(view, RowMappedStore):
        return
    raw = cast(RowMappedPrefetcher, pf).inner if isinstance(pf, RowMappedPrefetcher) else pf
    reader.prefetcher = cast("Prefetcher", RowMappedPrefetcher(raw, view))


def select_rows(layer: FlashLayer, src: torch.Tensor) -> None:
    """New row r of the layer is old row src[r] (src [b_new] long): every device tier
    indexed on its batch dim, the cold tier through the row map (no block copied)."""
    if not layer.is_initialized:
        return
    src = src.to(device=layer.device, dtype=torch.long)
    b_old = layer.sink_k.shape[0]
    if src.dim() != 1 or (src.numel() and (int(src.min()) < 0 or int(src.max()) >= b_old)):
        raise FlashMemError(
            f"batch rows {src.tolist()} do not fit the cache's {b_old} rows; allowed: row indices 0..{b_old - 1}"
        )
    if src.numel() == b_old and bool((src == torch.arange(b_old, device=src.device)).all()):
        return  # beam search's first steps keep every row where it is

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, src.to(t.device))

    for name in ("sink_k", "sink_v", "win_k", "win_v", "open_k", "open_v", "v_sum"):
        setattr(layer, name, pick(getattr(layer, name)))
    layer.validity.pick_rows(pick)
    summ = layer.summaries
    summ.hca_k, summ.hca_v, summ.hca_cnt = pick(summ.hca_k), pick(summ.hca_v), pick(summ.hca_cnt)
    summ.csa_blocks = deque((bid, pick(k), pick(v), pick(c)) for bid, k, v, c in summ.csa_blocks)
    if summ.recent_q is not None:
        summ.recent_q = pick(summ.recent_q)
    summ.rebuild_band()
    index = layer.index
    index.codes = pick(index.codes)
    if index.scales is not None:
        index.scales = pick(index.scales)
    ws = layer.working_set
    ws.code = [None if c is None else tuple(pick(t) for t in c) for c in ws.code]
    ws.plain = [None if p is None else pick(p) for p in ws.plain]
    ws.idx = None if ws.idx is None else pick(ws.idx)
    ws.valid = None if ws.valid is None else pick(ws.valid)
    spare = ws.spare
    if spare is not None and spare.ids is not None and spare.used is not None:
        # ids [b, h, s]; rows [b*h*s, X]: a row's slots are contiguous, so they move as [b, h*s, X]
        b_sp = spare.ids.shape[0]
        spare.ids, spare.used = pick(spare.ids), pick(spare.used)
        spare.code = [
            None if c is None else tuple(pick(t.view(b_sp, -1, t.shape[-1])).reshape(-1, t.shape[-1]) for t in c)
            for c in spare.code
        ]
    exact = layer.exact
    if exact.k is not None and exact.v is not None:
        exact.k, exact.v = pick(exact.k), pick(exact.v)
    _remap_cold(layer, src, b_old)
    layer.static = None  # decode_step: static starts a new segment, its page codes coded again
    layer.page_codes = None
    if layer.ranker.codes is not None:  # coded per row as the blocks sealed: rows follow as the index's do
        layer.ranker.codes.select_rows(src)
    if layer.ranker.device_codes is not None:  # copied again for the new rows at the next re-rank
        layer.ranker.device_codes.clear()
    pv = layer.ranker.page_values
    if pv is not None and pv.blocks:  # lsa_feedback_share: the pages' mean values, per row (host)
        pv.means = pv.means.index_select(0, src.to(pv.means.device))
    if src.numel() != b_old:
        _, h, _, d = layer.sink_k.shape
        layer.reader.bind((src.numel(), h, d), layer.device, layer.dtype, layer.cfg.sink_tokens)


def repeat(layer: FlashLayer, repeats: int) -> None:
    """`batch_repeat_interleave(repeats)`: rows 0, 0, .., 1, 1, .. (each `repeats` times)."""
    if repeats < 1:
        raise FlashMemError(f"batch_repeat_interleave({repeats}): allowed: a repeat count of 1 or more")
    if layer.is_initialized:
        select_rows(layer, torch.arange(layer.sink_k.shape[0], device=layer.device).repeat_interleave(repeats))


def select(layer: FlashLayer, indices: torch.Tensor) -> None:
    """`batch_select_indices(indices)`: keep the rows `indices` names (row ids or a bool mask)."""
    if not layer.is_initialized:
        return
    idx = torch.as_tensor(indices, device=layer.device)
    if idx.dtype == torch.bool:
        idx = idx.nonzero().flatten()
    select_rows(layer, idx.reshape(-1))


# ---------------------------------------------------------------------------- cache_implementation
CACHE_IMPLEMENTATION = "flashmem"


def register_cache_implementation() -> None:
    """Make `model.generate(..., cache_implementation="flashmem")` build a FlashMemoryCache
    (idempotent). transformers 5.24 has no registry for cache implementations: the names
    `GenerationConfig.validate` accepts are a module tuple (`ALL_CACHE_IMPLEMENTATIONS`),
    and `GenerationMixin._prepare_cache_for_generation` builds a DynamicCache for any name
    it does not know. So the name is added to that tuple, and the method is wrapped to
    build the cache with `flashmem.attach(model, ...)` from `cache_config`: None (the
    recipe), a FlashMemoryConfig, a YAML path, or a dict of attach's keywords (budget,
    tokens, config keys). Every other name goes to transformers unchanged."""
    from transformers.generation import configuration_utils, utils

    names = configuration_utils.ALL_CACHE_IMPLEMENTATIONS
    if CACHE_IMPLEMENTATION not in names:
        # the module's tuple is read by GenerationConfig.validate at every call
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = (*names, CACHE_IMPLEMENTATION)  # type: ignore[assignment]
    mixin = utils.GenerationMixin
    prepare = mixin._prepare_cache_for_generation
    if getattr(prepare, "_flashmem", False):
        return

    def prepare_cache(self: Any, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        if generation_config.cache_implementation != CACHE_IMPLEMENTATION:
            return prepare(self, generation_config, model_kwargs, *args, **kwargs)
        if model_kwargs.get("cache") is not None:
            raise FlashMemError('cache_implementation="flashmem" and a cache were both given; allowed: one of them')
        if generation_config.use_cache is not False:
            model_kwargs["cache"] = cache_for(self, generation_config.cache_config)
        return None

    prepare_cache._flashmem = True  # type: ignore[attr-defined]
    mixin._prepare_cache_for_generation = prepare_cache  # type: ignore[method-assign]


def cache_for(model: Any, cache_config: Any) -> Any:
    """The FlashMemoryCache `cache_implementation="flashmem"` builds for `model`."""
    from flashmem.cache.attach import attach
    from flashmem.config import FlashMemoryConfig

    if cache_config is None:
        return attach(model)
    if isinstance(cache_config, FlashMemoryConfig):
        return attach(model, cache_config)
    if isinstance(cache_config, str):
        return attach(model, FlashMemoryConfig.from_yaml(cache_config))
    if isinstance(cache_config, dict):
        return attach(model, **cache_config)
    raise FlashMemError(
        f'cache_config: a {type(cache_config).__name__} is not allowed with cache_implementation="flashmem"; '
        "allowed: None (the recipe), a FlashMemoryConfig, a YAML path, or a dict of attach() keywords"
    )
