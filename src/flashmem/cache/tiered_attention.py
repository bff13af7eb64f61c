"""A selecting step's attention over a layer's tiers: what a chunk of queries attends.

Per chunk (docs/design.md, "Data flow"): the sinks; then, once blocks are sealed,
the pages the index ranks highest (`ranking.py`), gathered into the working set
(`working_set.py`) with look-ahead queued for the next step, the summaries of what
is left out (HCA entries of far blocks, CSA entries of near ones) and the optional
rest entry; then the open block and the window, and the chunk's own tokens
(`assembly.py` runs the one attention). With `position_mode: window` the shown
pages, the open block, the window, the new keys and the queries move to
consecutive positions after the sinks.

The layer owns the state; these functions read it and ask its working set and
reader to change. Shapes: q [b, Hq, m, d]; qg (a KV head's GQA group, token-major)
[b, h, m*group, d]; page ids [b, h, k].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from flashmem.cache import ranking
from flashmem.cache.assembly import NEG, Assembly, RestEntry, bias_from_valid, rest_entry
from flashmem.index.selection import score_rows
from flashmem.rope import RopeRotator

if TYPE_CHECKING:
    from flashmem.cache.flash_layer import FlashLayer


def attend(
    layer: FlashLayer,
    q: torch.Tensor,
    qg: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    valid_new: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One chunk: q [b, Hq, m, d] over the tiers plus its own K/V -> [b, Hq, m, d]."""
    b, hkv, m, _ = k_new.shape
    asm = Assembly(b, hkv, q.dtype, q.device, layer.reader.decode_kv_bytes())
    S = layer.sink_k.shape[-2]
    asm.add_valid(layer.sink_k, layer.sink_v, layer.valid[:, :S])
    shown, rest = 0, None
    if layer.num_sealed > 0:
        shown, rest = _add_history(layer, asm, qg, m, scaling)
    q, k_new = _add_recent(layer, asm, q, k_new, shown)
    out = asm.attend(q, k_new, v_new, valid_new, scaling, rest)
    layer.reader.traffic.add("device_copy_bytes", asm.copied_bytes)
    return out


def _add_history(
    layer: FlashLayer, asm: Assembly, qg: torch.Tensor, m: int, scaling: float
) -> tuple[int, RestEntry | None]:
    """Select and gather pages, then add the summaries of what is left out and the
    working set. qg: [b, h, m*group, d] -> (tokens of pages shown in window mode, the
    rest entry or None)."""
    cfg = layer.cfg
    b, hkv = asm.b, asm.hkv
    n, ppb = layer.num_sealed, cfg.pages_per_block
    page_tokens_valid = layer.block_valid_tokens().reshape(b, n * ppb, cfg.page_tokens)  # [b, pages, P]
    k_sel = selection_size(layer, m)
    selected = torch.zeros(b, hkv, n * ppb, dtype=torch.bool, device=qg.device)  # per page
    reuse = _reuses_selection(layer, k_sel, m)
    every = not reuse and selects_every_page(layer, k_sel, n * ppb)
    # The rest entry needs every query's scores; a selection pools them, so a sample will do.
    q_index = qg if cfg.keeps_rest_entry else sample_queries(qg, m, cfg.lsa_prefill_queries)
    rows = score_rows(b, hkv, n * ppb, qg.device)  # query rows of scores within their bound
    scores = None
    rest_whole = cfg.keeps_rest_entry and not every and q_index.shape[2] <= rows
    if rest_whole or (k_sel > 0 and not reuse and layer.selection_hook is not None):
        # held whole only for those that read them (a selection pools them in blocks): the rest
        # entry where they are within SCORE_BLOCK_BYTES (a decode step's), a selection hook always
        scores = layer.ranker.scores(q_index, scaling, layer.summaries.hca_k)
    if reuse:
        selected.scatter_(-1, layer.working_set.reuse(layer.reader), True)
    elif every:
        _gather_every_page(layer, page_tokens_valid, m == 1)
        selected.fill_(True)
    elif k_sel > 0:
        page_valid = page_tokens_valid.any(-1)  # [b, pages]

        def mass() -> torch.Tensor:  # computed only where the ranking reads it
            return layer.ranker.index_mass(q_index, page_valid, scaling, layer.summaries.hca_k, scores)

        positions = q_index.shape[2] * m // qg.shape[2]  # query positions scoring the index
        idx = _select_and_gather(
            layer, mass, scores, page_tokens_valid, page_valid, k_sel, scaling, q_index, positions, m == 1
        )
        selected.scatter_(-1, idx, True)
    else:
        layer.working_set.clear()
    layer.summaries.add_to(asm, selected, n)
    shown = _add_working_set(layer, asm) if k_sel > 0 else 0
    rest = None
    if cfg.keeps_rest_entry and not every:  # every page attended: nothing is left out
        ws_valid = layer.working_set.valid if asm.working_set_part is not None else None
        blocks: Iterable[torch.Tensor] = (
            [scores] if scores is not None else _score_blocks(layer, q_index, scaling, rows)
        )
        rest = rest_entry(blocks, selected, page_tokens_valid, layer.v_sum, ws_valid, scaling, m)
    return shown, rest


def _score_blocks(layer: FlashLayer, q_index: torch.Tensor, scaling: float, rows: int) -> Iterator[torch.Tensor]:
    """The index's scores of q_index [b, h, nq, d], `rows` queries at a time -> [b, h, rows, pages]
    each: a prompt chunk's rest entry scores again what its selection pooled in blocks, rather
    than hold every query's scores (Llama-3.1-8B at 128K: 4.3 GB a 4,096-token chunk)."""
    for i0 in range(0, q_index.shape[2], rows):
        yield layer.ranker.scores(q_index[:, :, i0 : i0 + rows], scaling, layer.summaries.hca_k)


def selection_size(layer: FlashLayer, m: int) -> int:
    """Pages per row and KV head a chunk of m queries attends exactly: the budget's
    (`blocks_to_select`), plus what the open block's unused room buys (`lsa_open_room`)."""
    cfg = layer.cfg
    n_pages = layer.num_sealed * cfg.pages_per_block
    k_sel = cfg.blocks_to_select(n_pages)
    if cfg.lsa_open_room and k_sel > 0:
        k_sel = min(n_pages, k_sel + open_room_pages(layer, m))
    return k_sel


def _reuses_selection(layer: FlashLayer, k_sel: int, m: int) -> bool:
    """lsa_select_every: a decode step between selections attends the last one's pages as held."""
    b, hkv = layer.sink_k.shape[:2]
    rows = (int(b), int(hkv))
    return k_sel > 0 and m == 1 and layer.working_set.reusable(layer.num_sealed, rows, layer.cfg.lsa_select_every)


def decode_attends_every_page(layer: FlashLayer) -> bool:
    """Whether this layer's next one-token step, with blocks sealed, attends every sealed page
    exactly and nothing else of them (`selects_every_page`; not the last selection reused, an
    eager step at true positions): its keys are then sinks | every sealed token (the working set
    `hold_every_page` makes) | open block | window | the token, all valid ones seen, which a
    batch's shared attention computes for several rows at once (`cache/batched.py`)."""
    cfg = layer.cfg
    if layer.num_sealed == 0 or cfg.decode_step != "eager" or cfg.position_mode == "window":
        return False
    k_sel = selection_size(layer, 1)
    return not _reuses_selection(layer, k_sel, 1) and selects_every_page(
        layer, k_sel, layer.num_sealed * cfg.pages_per_block
    )


def hold_every_page(layer: FlashLayer) -> None:
    """A decode step's working set of every sealed page (`decode_attends_every_page`), read,
    counted and prefetched as `attend` does it."""
    cfg = layer.cfg
    b, n_pages = layer.sink_k.shape[0], layer.num_sealed * cfg.pages_per_block
    if not _keep_every_page(layer, b, n_pages, True):  # most steps between two seals keep them
        _read_every_page(layer, layer.block_valid_tokens().reshape(b, n_pages, cfg.page_tokens), True)


def selects_every_page(layer: FlashLayer, k_sel: int, n_pages: int) -> bool:
    """Whether this step's selection is every sealed page (k_sel covers them: a context
    shorter than the pages the budget buys, as most of a chat server's are): then nothing is
    ranked, re-ranked or left out for a rest entry, which would only find what this knows.
    A selection hook (a diagnostic) still sees the index's scores."""
    return 0 < n_pages <= k_sel and layer.selection_hook is None


def _gather_every_page(layer: FlashLayer, page_tokens_valid: torch.Tensor, decode: bool) -> None:
    """The working set of every sealed page, in order (held pages kept, new ones read), as
    `_select_and_gather` makes it when its ranking returns them all, without the ranking."""
    b, n_pages = page_tokens_valid.shape[:2]
    if not _keep_every_page(layer, b, n_pages, decode):
        _read_every_page(layer, page_tokens_valid, decode)


def _read_every_page(layer: FlashLayer, page_tokens_valid: torch.Tensor, decode: bool) -> None:
    """The working set made of every sealed page [b, n_pages, P] (held ones kept, new ones read)."""
    b, n_pages = page_tokens_valid.shape[:2]
    hkv = layer.sink_k.shape[1]
    idx = torch.arange(n_pages, device=page_tokens_valid.device).expand(b, hkv, n_pages).contiguous()
    _hold(layer, ranking.Selection(idx), page_tokens_valid, decode)


def _keep_every_page(layer: FlashLayer, b: int, n_pages: int, decode: bool) -> bool:
    """Whether the working set holds every one of the n_pages sealed pages already; then it is
    kept, counted and looked ahead from as a gather would. A selection's ids are distinct and
    made over these blocks or fewer (a crop of sealed blocks clears the set), so n_pages of them
    are every page: what `gather` finds comparing them, without its sort and compare."""
    ws = layer.working_set
    if ws.idx is None or tuple(ws.idx.shape) != (b, layer.sink_k.shape[1], n_pages):
        return False
    layer.reader.traffic.pages(ws.idx.numel(), 0, layer.reader.page_bytes())
    ws.selected(layer.num_sealed, decode)
    layer.reader.look_ahead(ws.idx, layer.num_sealed)
    return True


def open_room_pages(layer: FlashLayer, m: int) -> int:
    """Pages the open block's unused room buys (`lsa_open_room`): the solver sizes the budget
    with the open block full (B - 1 tokens, `predicted_ratio(peak=True)`); while it holds fewer,
    the bytes it does not use buy working-set pages, held back for the m tokens this chunk may
    add to it. Per row and KV head: a token is its K and V in the model's dtype, a page P of
    them as the working set holds them (int8: d codes and an fp32 scale each)."""
    cfg = layer.cfg
    d = layer.sink_k.shape[-1]
    free = cfg.hca_chunk_size - 1 - layer.open_k.shape[-2] - m
    if free <= 0:
        return 0
    token = 2 * d * layer.sink_k.element_size()
    per_elem = d + 4 if cfg.working_set_codec == "int8" else d * layer.sink_k.element_size()
    page = 2 * cfg.page_tokens * per_elem
    return free * token // page


def _select_and_gather(
    layer: FlashLayer,
    mass: Callable[[], torch.Tensor],
    scores: torch.Tensor | None,
    page_tokens_valid: torch.Tensor,
    page_valid: torch.Tensor,
    k_sel: int,
    scaling: float,
    q_index: torch.Tensor,
    positions: int,
    decode: bool,
) -> torch.Tensor:
    """Rank the pages by the index's pooled mass [b, h, pages] (`mass()`: computed only if a
    stage reads it), gather the chosen ones into the working set, queue look-ahead -> page ids
    [b, h, k]; scores [b, h, nq, pages] whole only for a selection hook. q_index: [b, h, nq, d]
    the queries that scored, from `positions` query positions (a long chunk's are re-ranked
    only when few enough); decode: a one-token step's selection, which the next
    lsa_select_every - 1 decode steps reuse."""
    cfg = layer.cfg
    rerank = cfg.lsa_rerank > 1 and positions <= ranking.RERANK_MAX_QUERIES
    ctx = (q_index, page_tokens_valid) if rerank else (None, None)
    sel = layer.ranker.rank(mass, page_valid, k_sel, scaling, ctx[0], ctx[1], layer.num_sealed)
    if layer.selection_hook is not None:
        assert scores is not None
        sel = ranking.Selection(layer.selection_hook(layer.layer_idx, sel.idx, scores), sel.candidates)
    _hold(layer, sel, page_tokens_valid, decode)
    return sel.idx


def _hold(layer: FlashLayer, sel: ranking.Selection, page_tokens_valid: torch.Tensor, decode: bool) -> None:
    """The selection's pages into the working set (held ones kept, the others read or cut from
    the candidates), noted for `lsa_select_every`, and the next step's prefetch queued."""
    key_copy = layer.ranker.key_copy(layer.num_sealed)
    layer.working_set.gather(sel.idx, page_tokens_valid, layer.reader, sel.candidates, key_copy)
    layer.working_set.selected(layer.num_sealed, decode)
    # prefetch for the next step (re-ranked: the candidates, which it reads again)
    ahead = sel.idx if sel.candidates is None else sel.candidates.ids
    layer.reader.look_ahead(ahead, layer.num_sealed)


def _add_working_set(layer: FlashLayer, asm: Assembly) -> int:
    """The working set's K/V (int8: codes and scales, decoded where attention reads them)
    -> tokens shown at window positions (position_mode: window), else 0."""
    ws = layer.working_set
    assert ws.valid is not None and ws.idx is not None
    ws_k, ws_v = ws.part(0), ws.part(1)
    shown = 0
    if layer.cfg.position_mode == "window":  # selected page j's tokens move to S + j*P .., right after the sinks
        assert ws.k is not None
        P, S = layer.cfg.page_tokens, layer.block_start
        true = S + ws.idx[..., None] * P + torch.arange(P, device=ws.idx.device)  # [b, h, k, P]
        moved = S + torch.arange(true[0, 0].numel(), device=ws.idx.device)
        ws_k = _rope(layer).rotate(ws.k, moved - true.flatten(-2))
        shown = ws.idx.shape[-1] * P
    asm.mark_working_set(ws_k, ws_v, torch.full_like(ws.valid, NEG, dtype=asm.dtype).masked_fill_(ws.valid, 0.0))
    return shown


def _add_recent(
    layer: FlashLayer, asm: Assembly, q: torch.Tensor, k_new: torch.Tensor, shown: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the open block and the window -> the queries and new keys, moved to follow the
    shown pages in window mode (a shift of every one of them by the same amount, queries
    included, keeps their relative positions)."""
    S = layer.block_start
    o0 = S + layer.num_sealed * layer.cfg.hca_chunk_size
    ks, vs = layer.tail_parts()  # one tensor each while joined (FlashLayer.append)
    shift = S + shown - o0 if layer.cfg.position_mode == "window" else 0
    if shift:
        rope = _rope(layer)
        delta = torch.tensor(float(shift), device=q.device)
        ks = [rope.rotate(k, delta) for k in ks]
        q, k_new = rope.rotate(q, delta), rope.rotate(k_new, delta)
    a = o0
    bias = bias_from_valid(layer.valid[:, o0:], asm.dtype)  # [b, 1, n]: every part's in one op
    for k, v in zip(ks, vs):
        n = k.shape[-2]
        asm.add(k, v, bias[..., a - o0 : a - o0 + n])
        a += n
    return q, k_new


def _rope(layer: FlashLayer) -> RopeRotator:
    assert layer.rope is not None  # checked in FlashLayer.__init__ for position_mode: window
    return layer.rope


def group_queries(q: torch.Tensor, group: int) -> torch.Tensor:
    """[b, Hq, m, d] -> [b, Hkv, m*group, d], token-major, each KV head's GQA group."""
    b, hq, m, d = q.shape
    return q.view(b, hq // group, group, m, d).transpose(2, 3).reshape(b, hq // group, m * group, d)


def sample_queries(qg: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """n evenly spaced of a chunk's m query positions, the last included, each with its
    whole GQA group: [b, h, m*group, d] -> [b, h, n*group, d]; all of them when n is 0 or >= m."""
    if n <= 0 or m <= n:
        return qg
    group = qg.shape[2] // m
    pos = (m - 1 - torch.arange(n, device=qg.device) * m // n).flip(0)  # distinct: m > n
    rows = (pos[:, None] * group + torch.arange(group, device=qg.device)).reshape(-1)
    return qg.index_select(2, rows)
