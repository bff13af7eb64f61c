"""Several sequences in one model forward: a batch of FlashMemoryCaches, one per row.

A FlashMemoryCache holds one sequence (its tiers, selection, cold tier and step
guard are per sequence). `BatchedCache` puts several of them side by side so that
the model's linear layers, which read every weight once per forward, run over all
rows at once (the point of continuous batching), while each row's attention
runs against its own cache exactly as it would alone.

The rows' new tokens are packed into one sequence (`forward`): row r owns the
tokens [offsets[r], offsets[r] + lengths[r]) of a single batch row, so rows with
different numbers of new tokens (a prompt chunk beside decode steps) share a
forward without padding, and the linear layers see every row's tokens as one
matrix (SmolLM2 on one CPU thread: a plain forward of 40 tokens costs 137 ms,
one of 8 rows' decode steps 124 ms, so a chunk rides along a decode round for
little more than the round):

- `update` hands row r its own new K/V (`key_states[:, :, a_r:a_r + n_r]`) and
  returns the new keys tagged with every row's answer;
- the registered attention function (`cache/attention.py`) sees the tag and calls
  `rows_attention`, which runs row r's queries through row r's layer: a FlashLayer's
  step (selection, tiers) or, for layers flashmem does not manage, SDPA over the
  row's own keys with the row's own causal (or sliding-window) mask;
- positions are per token (`forward` passes position ids = each row's length
  onwards), so sequences of different lengths share a forward.

Attention is the only place tokens meet, and there each row sees only its own
tokens; each row's logits are taken at its last token.

Decode steps of rows whose managed layer attends every token it holds attend in one
SDPA over the rows' padded keys (`_attend_short`): a row with no sealed block yet (a
short chat: sinks, open block and window only; nothing to select), or one whose budget
covers every sealed page (most chats past their first block: nothing is ranked, the
working set holds every page, `tiered_attention.decode_attends_every_page`). With one
query each, a row's attention is then its sinks | sealed pages | open block | window |
new token, and a per-row step would cost more in Python than the attention itself (at
SmolLM2's size, 8 rows x 30 layers of it took about as long as the batched linear
layers). Other rows (pages ranked, a prompt chunk) take the layer's own step
(`FlashLayer.step` through `flashmem_attention`).

A row whose step raises (a damaged cold block, a closed cache) is marked failed
and skipped for the rest of the forward; the others finish the step
(`BatchedCache.failures`). Rows join and leave between forwards: the batch is a
light wrapper, built per forward over the live sequences' caches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flashmem.cache import sdpa, tiered_attention
from flashmem.cache.assembly import concat, one_pass_decode, step_scratch
from flashmem.cache.flash_cache import FlashMemoryCache
from flashmem.cache.flash_layer import FlashLayer
from flashmem.cache.working_set import Part
from flashmem.compress import page_code
from flashmem.errors import FlashMemError


@dataclass
class RowKV:
    """What row `row`'s cache layer returned for this forward: keys/values to attend, the
    row's number of new tokens and where they start in the packed forward."""

    row: int
    layer: Any
    k: torch.Tensor
    v: torch.Tensor
    n: int
    at: int = 0


class _LayerKind:
    """Stands in for a cache layer where transformers asks the batch about its layers
    (`is_sliding` when it picks the mask's layer); the state lives in the rows."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, is_sliding: bool) -> None:
        self.is_sliding = is_sliding


class BatchedCache(Cache):
    """Rows of FlashMemoryCaches (the same model and config) run in one forward.

    Use `forward(model, batch, tokens)`; `rows` may change between forwards."""

    def __init__(self, rows: list[FlashMemoryCache]) -> None:
        if not rows:
            raise FlashMemError("a batch needs at least one row (a FlashMemoryCache); allowed: 1 or more")
        n_layers = len(rows[0].layers)
        if any(len(r.layers) != n_layers for r in rows):
            raise FlashMemError("rows of a batch must be caches of the same model; got different layer counts")
        if any(r.cfg.exact_on_doubt for r in rows):  # its hook undoes whole forwards of one cache
            raise FlashMemError(
                "exact_on_doubt is not allowed in a batch of rows (BatchedCache: the batched server); "
                "allowed: exact_on_doubt: 0 there, or one FlashMemoryCache per sequence"
            )
        self.rows = list(rows)
        self.lengths = [1] * len(rows)
        self.offsets = list(range(len(rows)))
        self.failures: dict[int, BaseException] = {}
        self._memo: dict[tuple[Any, ...], torch.Tensor] = {}  # per forward: tensors every layer shares
        kinds: list[Any] = [_LayerKind(bool(getattr(x, "is_sliding", False))) for x in rows[0].layers]
        super().__init__(layers=kinds)

    def begin(self, lengths: list[int]) -> None:
        """Before a forward: row r brings lengths[r] new tokens, packed after the rows before it."""
        if len(lengths) != len(self.rows) or min(lengths) < 1:
            raise FlashMemError(
                f"new-token counts {lengths} for {len(self.rows)} rows; allowed: one count >= 1 per row"
            )
        self.lengths = list(lengths)
        self.offsets = [sum(lengths[:r]) for r in range(len(lengths))]
        self.failures = {}
        self._memo = {}

    def per_forward(self, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """make(), made once per forward for each key: what every layer uses (the rows' token
        positions, padding that each slices)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    @property
    def total(self) -> int:
        """New tokens of all rows: the packed forward's length."""
        return sum(self.lengths)

    def fail(self, row: int, exc: BaseException) -> None:
        """Row `row` stops for the rest of this forward (its cache's guard already holds the error)."""
        self.failures.setdefault(row, exc)

    # ------------------------------------------------------------ transformers API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states: [1, h, total, d], every row's new tokens packed -> the
        same tensors, the keys tagged with each row's (layer, K, V) for `rows_attention`."""
        if key_states.shape[0] != 1 or key_states.shape[2] != self.total:
            raise FlashMemError(
                f"a forward of {tuple(key_states.shape[::2])} (batch, tokens) on a batch of {len(self.rows)} "
                f"caches packing {self.total} new tokens; allowed: (1, {self.total})"
            )
        answers: list[RowKV | None] = []
        for r, cache in enumerate(self.rows):
            n, a = self.lengths[r], self.offsets[r]
            if r in self.failures:
                answers.append(None)
                continue
            try:
                k, v = cache.update(key_states[:, :, a : a + n], value_states[:, :, a : a + n], layer_idx)
            except Exception as exc:  # noqa: BLE001 - one row fails, the batch goes on
                self.fail(r, exc)
                answers.append(None)
                continue
            answers.append(RowKV(r, cache.layers[layer_idx], k, v, n, a))
        tagged = key_states.view_as(key_states)
        tagged._flashmem_rows = (self, answers)  # type: ignore[attr-defined]
        return tagged, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row (transformers' default positions; `forward` gives each row its own)."""
        return max(r.get_seq_length() for r in self.rows)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # Rows build their own masks (rows_attention); the model's mask is unused.
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    tag: tuple[BatchedCache, list[RowKV | None]],
    scaling: float | None,
    dropout: float,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Each row's queries over its own cache layer. query: [1, Hq, total, d] (the rows'
    tokens packed) -> [1, total, Hq, d] (failed rows' outputs are zeros)."""
    from flashmem.cache.attention import flashmem_attention

    batch, answers = tag
    b, hq, q, d = query.shape
    out = query.new_zeros(b, q, hq, d)
    kwargs.pop("position_ids", None)  # the batch's, not a row's; attention does not read them
    short: list[RowKV] = []
    for ans in answers:
        if ans is None or ans.row in batch.failures:
            continue
        if _short_decode(ans):
            short.append(ans)
            continue
        r, n, a = ans.row, ans.n, ans.at
        q_r = query[:, :, a : a + n]
        try:
            if getattr(ans.k, "_flashmem_layer", None) is not None:
                o, _ = flashmem_attention(module, q_r, ans.k, ans.v, None, scaling=scaling, dropout=dropout, **kwargs)
            else:
                mask = _plain_mask(ans.layer, n, ans.k.shape[-2], query.device)
                o, _ = sdpa_attention_forward(
                    module, q_r, ans.k, ans.v, mask, scaling=scaling, dropout=dropout, **kwargs
                )
        except Exception as exc:  # noqa: BLE001 - one row fails, the batch goes on
            batch.fail(r, exc)
            continue
        out[0, a : a + n] = o[0]
    if short:
        _attend_short(batch, query, short, d**-0.5 if scaling is None else scaling, out)
    return out, None


def _short_decode(ans: RowKV) -> bool:
    """Whether row `ans` is a one-token step of a FlashLayer that attends every token it holds
    (no sealed block yet, or every sealed page within the budget:
    `tiered_attention.decode_attends_every_page`), what `_attend_short` computes as the
    layer's step would; not a prompt attended exactly."""
    layer = getattr(ans.k, "_flashmem_layer", None)
    return (
        isinstance(layer, FlashLayer)
        and ans.n == 1
        and layer.selection_hook is None
        and not layer.exact_prompt(1)  # as _layer_step asks: it ends an exact prompt's buffer
        and (layer.num_sealed == 0 or tiered_attention.decode_attends_every_page(layer))
    )


@dataclass
class _RowParts:
    """One row's keys, values and validity for the shared attention: parts [1, h, n_i, d] and
    [1 or h, n_i] (bool), with the bytes its step alone would have copied beyond assembling them.
    With `pages` > 0, k[1], v[1] and seen[1] are its working set's pages (that many tokens)."""

    k: list[Part]
    v: list[Part]
    seen: list[torch.Tensor]
    length: int
    extra_copy: int
    pages: int = 0


def _row_parts(layer: FlashLayer, k_new: torch.Tensor, v_new: torch.Tensor, one: torch.Tensor) -> _RowParts:
    """sinks | every sealed page (the working set, held as the row's step holds it: read,
    counted and prefetched; int8 decoded) | open block and window | the new token (one: its
    validity [1, 1], True)."""
    hkv, dev = k_new.shape[1], k_new.device
    tk, tv = layer.tail_parts()
    valid = layer.valid  # [1, tokens seen]
    if layer.num_sealed == 0:  # the same validity in every head: one row of it
        return _RowParts([layer.sink_k, *tk, k_new], [layer.sink_v, *tv, v_new], [valid, one], valid.shape[-1] + 1, 0)
    tiered_attention.hold_every_page(layer)
    ws, S = layer.working_set, layer.block_start
    assert ws.valid is not None
    o0 = S + layer.num_sealed * layer.cfg.hca_chunk_size
    pk, pv = ws.part(0), ws.part(1)
    # the row's step alone decodes int8 pages into its buffer in two passes on a CPU (assembly.copy_bytes)
    coded = [isinstance(p, tuple) and not one_pass_decode(dev) for p in (pk, pv)]
    n_ws = ws.valid.shape[-1]
    return _RowParts(
        [layer.sink_k, pk, *tk, k_new],
        [layer.sink_v, pv, *tv, v_new],
        [valid[:, :S].expand(hkv, -1), ws.valid[0], valid[:, o0:].expand(hkv, -1), one.expand(hkv, 1)],
        valid.shape[-1] - (o0 - S) + n_ws + 1,
        2 * n_ws * (coded[0] * k_new.nbytes + coded[1] * v_new.nbytes),
        n_ws,
    )


def _attend_short(
    batch: BatchedCache, query: torch.Tensor, rows: list[RowKV], scaling: float, out: torch.Tensor
) -> None:
    """One decode step of every row in `rows` (see `_short_decode`) in one SDPA: row r's
    query over its `_row_parts` (its own padding hidden, the batch's padding to the longest row
    hidden), then each layer's bookkeeping and append, as `FlashLayer.step` does them. out[0, at] gets the output
    [Hq, d] of the row whose token is at `at`. Per row: naming its parts, holding its pages, its
    bookkeeping; the keys and values, mask, queries, attention and outputs are an op or two for
    all rows (`_padded_attention`)."""
    hq, dev = query.shape[1], query.device
    one = torch.ones(1, 1, dtype=torch.bool, device=dev)  # the new token sees itself
    live: list[tuple[RowKV, FlashLayer, tuple[torch.Tensor, torch.Tensor], _RowParts]] = []
    for ans in rows:
        layer = ans.k._flashmem_layer  # type: ignore[attr-defined]
        pending = layer.take_pending()
        try:
            live.append((ans, layer, pending, _row_parts(layer, pending[0], pending[1], one)))
        except Exception as exc:  # noqa: BLE001 - a damaged cold block: the row fails alone
            _fail_row(batch, ans, layer, exc, out)
    if not live:
        return
    parts = [p for *_, p in live]
    hkv = live[0][2][0].shape[1]
    group = hq // hkv
    ats = tuple(ans.at for ans, *_ in live)
    at = batch.per_forward(("at", ats, dev), lambda: torch.tensor(ats, device=dev))
    q = query[0].index_select(1, at)  # [Hq, b, d]
    o, qg = _padded_attention(batch, q, parts, scaling, group)  # [b, Hq, d]; [hkv, group, b, d]
    out[0].index_copy_(0, at, o)
    for i, (ans, layer, (k_new, v_new), p) in enumerate(live):
        try:  # FlashLayer.step's bookkeeping after its attention
            layer.scaling = scaling
            # the buffer the row's step alone assembles (its summaries' entries too, hidden), written
            # and read back (assembly.copy_bytes: nothing when the new token is the only part)
            n = p.length + layer.summaries.entries()
            if n > 1:
                copied = 2 * n * (k_new.nbytes + v_new.nbytes) + p.extra_copy
                layer.reader.traffic.add("device_copy_bytes", copied)
            read = layer.attended_bytes() + 2 * k_new.nbytes
            layer.finish_step(read, k_new, v_new, one, qg[None, :, :, i], group)  # queries [1, hkv, group, d]
        except Exception as exc:  # noqa: BLE001 - one row fails, the batch goes on
            _fail_row(batch, ans, layer, exc, out)


def _padded_attention(
    batch: BatchedCache, q: torch.Tensor, rows: list[_RowParts], scaling: float, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' keys and values padded to the longest row ([b, hkv, L, d]: one cat for all
    rows, `_catted_kv`, or from WRITE_MIN_TOKENS padded tokens written into reused buffers,
    `_written_kv`), each row's query over its own keys, its padding and the batch's hidden.
    q: [Hq, b, d] -> ([b, Hq, d], the grouped queries [hkv, group, b, d])."""
    hq, b, d = q.shape
    hkv = hq // group
    L = max(r.length for r in rows)
    seen = _padded_seen(batch, rows, L)  # [b, H, L]
    K, V = _catted_kv(batch, rows, L) if b * L < WRITE_MIN_TOKENS else _written_kv(rows, L)
    mask = seen[:, :, None]  # [b, 1, 1, L], or per query head h*group + g:
    if seen.shape[1] > 1:
        mask = seen[:, :, None, None].expand(b, hkv, group, 1, L).reshape(b, hq, 1, L)
    qb = q.transpose(0, 1)[:, :, None].contiguous()  # [b, Hq, 1, d]
    o = sdpa.attention(qb, K, V, mask, scaling, hq > hkv)
    return o[:, :, 0], q.view(hkv, group, b, d)


def _padded_seen(batch: BatchedCache, rows: list[_RowParts], L: int) -> torch.Tensor:
    """Every row's validity and then False to L, in one cat -> [b, H, L] (H: 1, or hkv where a
    row's pages may differ by head)."""
    heads = max(t.shape[0] for r in rows for t in r.seen)
    dev = rows[0].seen[0].device
    pad = batch.per_forward(("seen", heads, L, dev), lambda: torch.zeros(heads, L, dtype=torch.bool, device=dev))
    parts: list[torch.Tensor] = []
    for r in rows:
        parts.extend(t.expand(heads, -1) for t in r.seen)
        if r.length < L:
            parts.append(pad[:, : L - r.length])
    return torch.cat(parts, dim=-1).view(heads, len(rows), L).transpose(0, 1)


def _catted_kv(batch: BatchedCache, rows: list[_RowParts], L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's parts and zeros to L in one cat each (int8 pages decoded first, in one call
    for all rows: `_decoded_pages`) -> K, V [b, hkv, L, d] (views of [1, hkv, b*L, d]).
    For a small batch, writing each row into a buffer costs more than one cat and a gather for
    all rows (stop 51: 8 short chat rows in bf16, 112 against 91.5 ms a round), and this cat
    needs no gather."""
    new = rows[0].k[-1]  # the new token's keys [1, hkv, 1, d]
    assert isinstance(new, torch.Tensor)
    _, hkv, _, d = new.shape
    dt, dev = new.dtype, new.device
    # zeros, not uninitialised: a masked key's value still meets a 0 weight
    pad = batch.per_forward(("kv", hkv, L, d, dt, dev), lambda: torch.zeros(1, hkv, L, d, dtype=dt, device=dev))
    out = []
    for slot in ("k", "v"):
        pages = _decoded_pages(rows, slot, dt)
        parts: list[torch.Tensor] = []
        for r, pg in zip(rows, pages):
            for j, p in enumerate(getattr(r, slot)):
                if j == 1 and pg is not None:
                    parts.append(pg)
                else:
                    assert isinstance(p, torch.Tensor)
                    parts.append(p)
            if r.length < L:
                parts.append(pad[:, :, : L - r.length])
        out.append(torch.cat(parts, dim=-2).view(hkv, len(rows), L, d).transpose(0, 1))
    return out[0], out[1]


def _decoded_pages(rows: list[_RowParts], slot: str, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Each row's pages (`_RowParts.pages`) as a tensor [1, hkv, n, d] (None: no pages): int8
    (codes, scale) ones decoded in one call for all rows, then split."""
    parts = [getattr(r, slot)[1] if r.pages else None for r in rows]
    coded = [p for p in parts if isinstance(p, tuple)]
    if len(coded) < 2:
        return [p if not isinstance(p, tuple) else page_code.decode(p[0], p[1], dtype) for p in parts]
    plain = page_code.decode(torch.cat([c[0] for c in coded], -2), torch.cat([c[1] for c in coded], -2), dtype)
    split = iter(plain.split([c[0].shape[-2] for c in coded], dim=-2))
    return [next(split) if isinstance(p, tuple) else p for p in parts]


# Padded tokens (rows x the longest row) from which the rows' parts are written into reused
# buffers: below, one cat for all rows costs fewer ops than a few writes per row; above, the cat's
# fresh copy (and the pages it faults in) loses to one copy into memory already there (8 rows of
# 1K tokens).
WRITE_MIN_TOKENS = 2048


def _written_kv(rows: list[_RowParts], L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's parts written into its place in reused buffers [b, hkv, L, d] (int8 pages
    decoded there; padding zeros): one copy of the bytes and no fresh pages to fault in."""
    scratch = step_scratch()  # fresh buffers under autograd
    new = rows[0].k[-1]  # the new token's keys [1, hkv, 1, d]
    assert isinstance(new, torch.Tensor)
    _, hkv, _, d = new.shape
    out = []
    for slot in ("k", "v"):
        buf = scratch.take(f"rows_{slot}", (len(rows), hkv, L, d), new.dtype, new.device)
        for i, r in enumerate(rows):
            view = buf[i : i + 1, :, : r.length]
            got = concat(getattr(r, slot), functools.partial(_same, view))
            if got is not view:  # autograd: concat made its own tensor
                view.copy_(got)
            if r.length < L:
                buf[i, :, r.length :] = 0.0  # hidden, but finite: a masked key's value still meets a 0 weight
        out.append(buf)
    return out[0], out[1]


def _same(view: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`concat`'s buffer: the row's place in the padded batch (shape: its parts' total)."""
    return view


def _fail_row(batch: BatchedCache, ans: RowKV, layer: FlashLayer, exc: BaseException, out: torch.Tensor) -> None:
    """Row `ans` fails for the rest of the forward: its guard holds the error, its output is zeros."""
    if layer.guard is not None:
        layer.guard.fail(exc)
    batch.fail(ans.row, exc)
    out[0, ans.at] = 0.0


def _plain_mask(layer: Any, n: int, kv: int, device: torch.device) -> torch.Tensor | None:
    """The boolean mask [1, 1, n, kv] of a row's n new queries over the kv keys its plain
    layer returned (they end with the new ones): causal, and within the window for a
    sliding layer. None for one query (it sees every key returned, as SDPA does alone)."""
    if n == 1:
        return None
    end = layer.cumulative_length if isinstance(layer, DynamicSlidingWindowLayer) else kv
    kpos = torch.arange(end - kv, end, device=device)
    qpos = torch.arange(end - n, end, device=device)
    mask = kpos[None, :] <= qpos[:, None]
    if isinstance(layer, DynamicSlidingWindowLayer):
        mask &= qpos[:, None] - kpos[None, :] < layer.sliding_window
    elif not isinstance(layer, DynamicLayer):
        raise FlashMemError(f"batched attention over a {type(layer).__name__} layer is not supported")
    return mask[None, None]


def forward(model: Any, batch: BatchedCache, tokens: list[list[int]]) -> list[torch.Tensor | None]:
    """One model forward of every row's new tokens (row r: tokens[r], at least one), packed
    into one sequence -> each row's logits [vocab] (fp32) after its last token; None for a
    row that failed (`batch.failures` says why; its cache is unusable from here on)."""
    if len(tokens) != len(batch.rows):
        raise FlashMemError(f"{len(tokens)} token lists for a batch of {len(batch.rows)} rows")
    lengths = [len(t) for t in tokens]
    batch.begin(lengths)
    total, dev = batch.total, model.device
    ids = torch.tensor([[t for row in tokens for t in row]], dtype=torch.long)
    pos = torch.cat([row.get_seq_length() + torch.arange(n) for row, n in zip(batch.rows, lengths)])[None]
    # A 4D mask is used as given (transformers builds none). Nothing reads it: every layer's
    # attention is `rows_attention`, where each row builds its own; a view, no T x T bytes.
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev).expand(1, 1, total, total)
    keep = [a + n - 1 for a, n in zip(batch.offsets, lengths)]
    with torch.inference_mode():
        out = model(
            input_ids=ids.to(dev),
            position_ids=pos.to(dev),
            attention_mask=mask,
            cache=batch,
            use_cache=True,
            logits_to_keep=torch.tensor(keep, device=dev),
        )
    return [None if r in batch.failures else out.logits[0, r].float() for r in range(len(lengths))]
