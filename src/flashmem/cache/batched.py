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

Decode steps of rows whose managed layer holds no sealed block yet (a short chat:
sinks, open block and window only; nothing to select) attend in one SDPA over the
rows' padded keys (`_attend_short`): with one query each, a row's attention is then
just its sinks | open block | window | new token, and a per-row step would cost
more in Python than the attention itself (at SmolLM2's size, 8 rows x 30 layers of
it took about as long as the batched linear layers). Other rows take the layer's
own step (`FlashLayer.step` through `flashmem_attention`).

A row whose step raises (a damaged cold block, a closed cache) is marked failed
and skipped for the rest of the forward; the others finish the step
(`BatchedCache.failures`). Rows join and leave between forwards: the batch is a
light wrapper, built per forward over the live sequences' caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flashmem.cache import sdpa
from flashmem.cache.flash_cache import FlashMemoryCache
from flashmem.cache.flash_layer import FlashLayer
from flashmem.cache.tiered_attention import group_queries
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
        self.rows = list(rows)
        self.lengths = [1] * len(rows)
        self.offsets = list(range(len(rows)))
        self.failures: dict[int, BaseException] = {}
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
    """Whether row `ans` is a one-token step of a FlashLayer with no sealed block (what
    `_attend_short` computes as the layer's step would), not a prompt attended exactly."""
    layer = getattr(ans.k, "_flashmem_layer", None)
    return (
        isinstance(layer, FlashLayer)
        and ans.n == 1
        and layer.num_sealed == 0
        and layer.selection_hook is None
        and not layer.exact_prompt(1)  # as _layer_step asks: it ends an exact prompt's buffer
    )


def _attend_short(
    batch: BatchedCache, query: torch.Tensor, rows: list[RowKV], scaling: float, out: torch.Tensor
) -> None:
    """One decode step of every row in `rows` (see `_short_decode`) in one SDPA: row r's
    query over its sinks | open block | window | new token (its own padding hidden, the
    batch's padding to the longest row hidden), then each layer's bookkeeping and append,
    as `FlashLayer.step` does them. out[0, at] gets the output [Hq, d] of the row whose
    token is at `at`. Per row only what differs by row runs in Python (naming its parts, its
    bookkeeping); the keys, values, mask, queries and outputs move for all rows in one op or
    two each."""
    layers = [ans.k._flashmem_layer for ans in rows]  # type: ignore[attr-defined]
    pending = [layer.take_pending() for layer in layers]
    b, (hq, d), dev = len(rows), query.shape[1::2], query.device
    hkv = pending[0][0].shape[1]
    group = hq // hkv
    lengths = [layer.validity.length + 1 for layer in layers]
    L = max(lengths)
    # Every row's sinks | open block and window | new token, row after row, in one cat each
    # (K, V and their validity; the new token sees itself) -> [hkv, N, d] and [N] ...
    ks, vs, seen = [], [], []
    one = torch.ones(1, 1, dtype=torch.bool, device=dev)
    for layer, (k_new, v_new) in zip(layers, pending):
        tk, tv = layer.tail_parts()
        ks += [layer.sink_k, *tk, k_new]
        vs += [layer.sink_v, *tv, v_new]
        seen += [layer.valid, one]
    flat_k, flat_v = torch.cat(ks, dim=-2)[0], torch.cat(vs, dim=-2)[0]
    flat_seen = torch.cat(seen, dim=-1)[0]
    # ... then gathered into [b, hkv, L, d]: row r's position t is flat token starts[r] + t,
    # and past the row's length its last token again, hidden by the mask
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    pos = torch.arange(L, device=dev)
    length = torch.tensor(lengths, device=dev)[:, None]
    idx = (torch.tensor(starts, device=dev)[:, None] + torch.minimum(pos, length - 1)).view(-1)  # [b*L]
    K = flat_k.index_select(1, idx).view(hkv, b, L, d).transpose(0, 1)
    V = flat_v.index_select(1, idx).view(hkv, b, L, d).transpose(0, 1)
    mask = flat_seen[idx].view(b, L) & (pos < length)  # [b, L]
    at = torch.tensor([ans.at for ans in rows], device=dev)
    q = query[0].index_select(1, at).transpose(0, 1)[:, :, None].contiguous()  # [b, Hq, 1, d]
    o = sdpa.attention(q, K, V, mask[:, None, None], scaling, hq > hkv)
    out[0].index_copy_(0, at, o[:, :, 0])
    qg = group_queries(q, group)  # [b, h, group, d]
    for i, (ans, layer, (k_new, v_new)) in enumerate(zip(rows, layers, pending)):
        try:  # FlashLayer.step's bookkeeping after its attention
            layer.scaling = scaling
            # the row's part of the K/V buffer, written and read back, as its step alone counts it
            # (assembly.copy_bytes: nothing when the new token is the only part)
            if lengths[i] > 1:
                layer.reader.traffic.add("device_copy_bytes", 2 * lengths[i] * (k_new.nbytes + v_new.nbytes))
            layer.finish_step(layer.attended_bytes() + 2 * k_new.nbytes, k_new, v_new, one, qg[i : i + 1], group)
        except Exception as exc:  # noqa: BLE001 - one row fails, the batch goes on
            if layer.guard is not None:
                layer.guard.fail(exc)
            batch.fail(ans.row, exc)
            out[0, ans.at] = 0.0  # a failed row's output is zeros, as for rows failed before


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
