"""The attention function flashmem registers with transformers.

Per managed layer and chunk of queries (DESIGN.md steps 2-4): score sealed
blocks with this chunk's queries, gather the top ones exactly, and attend once
over sinks | HCA entries of unselected far blocks | CSA entries of unselected
near blocks | selected blocks | open block | window | new tokens (causal).
Then the new tokens join the tiers. Long prompts are processed in chunks of
`prefill_chunk` queries, each attending through the same tiers, so the cache
never holds more than its budget.

Layers that flashmem does not manage (full layers, sliding-window layers) fall
through to transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flashmem.cache.flash_layer import FlashLayer
from flashmem.index.selection import select_blocks

# Must not contain "flash": transformers routes such names to flash-attention kernels.
NAME = "tiered_kv"


def flashmem_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: [b, Hq, q, d]; key/value: what `cache.update` returned -> out [b, q, Hq, d]."""
    layer: FlashLayer | None = getattr(key, "_flashmem_layer", None)
    if layer is None or layer.pending is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    k_new, v_new = layer.pending
    layer.pending = None
    b, hq, q, d = query.shape
    group = hq // k_new.shape[1]
    scaling = d**-0.5 if scaling is None else scaling
    layer.scaling = scaling
    start = layer.tokens_seen - q
    valid_new = _new_token_validity(attention_mask, b, start, q, query.device)

    outs = []
    for a, e in _chunks(q, layer.cfg.prefill_chunk):
        qc = query[:, :, a:e]
        qg = _group_queries(qc, group)
        outs.append(_attend(layer, qc, qg, k_new[:, :, a:e], v_new[:, :, a:e], valid_new[:, a:e], scaling))
        layer.append(k_new[:, :, a:e], v_new[:, :, a:e], valid_new[:, a:e], qg, group)
        resident = sum(layer.resident_bytes().values())
        layer.peak_resident_bytes = max(layer.peak_resident_bytes, resident)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


# The last queries of a prompt (the question) select their own blocks instead of
# sharing a whole chunk's pooled choice, and the very last query, whose logits
# emit the first generated token, selects alone, as every decode step does:
# pooled with the question's earlier words ("What is the ...") the block it
# needs can be outvoted (on an 8K Gemma3-270m passkey prompt the last query
# alone picked the needle's block in a layer where the pooled question did not).
TAIL_QUERIES = 32


def _chunks(q: int, step: int) -> list[tuple[int, int]]:
    """Query ranges [a, e): chunks of `step`, the last TAIL_QUERIES split off,
    then the last query on its own."""
    bounds = list(range(0, q, step)) + [q]
    if q > 1 and bounds[-1] - bounds[-2] > TAIL_QUERIES:
        bounds.insert(-1, q - TAIL_QUERIES)
    if q > 1 and bounds[-1] - bounds[-2] > 1:
        bounds.insert(-1, q - 1)
    return list(zip(bounds[:-1], bounds[1:]))


def _new_token_validity(
    mask: torch.Tensor | None, b: int, start: int, q: int, device: torch.device
) -> torch.Tensor:
    """[b, q] True where a new token is real (not padding).

    The mask spans every absolute position (FlashLayer.get_mask_sizes); its last
    query row sees all earlier positions causally, so a False there is padding.
    """
    if mask is None:
        return torch.ones(b, q, dtype=torch.bool, device=device)
    row = mask[:, 0, -1, start : start + q]
    if row.dtype != torch.bool:  # additive float mask
        row = row == 0
    return row.expand(b, q).to(device)


def _group_queries(q: torch.Tensor, group: int) -> torch.Tensor:
    """[b, Hq, m, d] -> [b, Hkv, m*group, d], token-major, each KV head's GQA group."""
    b, hq, m, d = q.shape
    return q.view(b, hq // group, group, m, d).transpose(2, 3).reshape(b, hq // group, m * group, d)


def _attend(
    layer: FlashLayer,
    q: torch.Tensor,
    qg: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    valid_new: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One chunk: q [b, Hq, m, d] over the tiers plus its own K/V -> [b, Hq, m, d]."""
    cfg = layer.cfg
    b, hkv, m, d = k_new.shape
    neg = float("-inf")
    keys, values, biases = [], [], []

    def add(k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> None:
        if k.shape[-2]:
            keys.append(k)
            values.append(v)
            biases.append(bias.expand(b, hkv, k.shape[-2]) if bias.dim() == 3 else bias)

    def from_valid(valid: torch.Tensor) -> torch.Tensor:  # [b, L] -> [b, 1, L]
        return torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill(~valid, neg)[:, None]

    S = layer.sink_k.shape[-2]
    add(layer.sink_k, layer.sink_v, from_valid(layer.valid[:, :S]))

    n = layer.num_sealed
    if n > 0:
        block_tokens_valid = layer.block_valid_tokens()  # [b, n, B]
        k_sel = cfg.blocks_to_select(n)
        selected = torch.zeros(b, hkv, n, dtype=torch.bool, device=q.device)
        if k_sel > 0:
            summaries = layer.summaries if layer.scorer.vectors else layer.hca_k[:, :, :, None]
            scores = layer.scorer.score(qg, summaries, scaling)  # [b, h, m*g, n]
            idx = select_blocks(scores, block_tokens_valid.any(-1), k_sel, scaling)  # [b, h, k]
            selected.scatter_(-1, idx, True)
            _gather_working_set(layer, idx, block_tokens_valid)
            layer.look_ahead(idx)  # DESIGN step 5: prefetch for the next step
        else:
            layer.ws_idx = layer.ws_k = layer.ws_v = layer.ws_valid = None
        # Far blocks (out of the near band) are represented by their HCA entry.
        band_start = n - len(layer.csa_blocks)
        far = torch.arange(n, device=q.device) < band_start
        if cfg.use_summaries:
            add(layer.hca_k, layer.hca_v, _entry_bias(layer.hca_cnt, far & ~selected, cfg.summary_bias, q.dtype))
        if cfg.use_summaries and layer.csa_k.shape[-2]:
            ids = layer.csa_block_ids.expand(b, hkv, -1)
            use = ~selected.gather(-1, ids)
            add(layer.csa_k, layer.csa_v, _entry_bias(layer.csa_cnt, use, cfg.summary_bias, q.dtype))
        if k_sel > 0:
            add(layer.ws_k, layer.ws_v, torch.zeros_like(layer.ws_valid, dtype=q.dtype).masked_fill(~layer.ws_valid, neg))

    o0 = S + n * cfg.hca_chunk_size
    o1 = o0 + layer.open_k.shape[-2]
    w1 = o1 + layer.win_k.shape[-2]
    add(layer.open_k, layer.open_v, from_valid(layer.valid[:, o0:o1]))
    add(layer.win_k, layer.win_v, from_valid(layer.valid[:, o1:w1]))

    # New tokens: causal among themselves, padding hidden; each sees itself so no row is empty.
    causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
    allowed = (causal[None] & valid_new[:, None, :]) | torch.eye(m, dtype=torch.bool, device=q.device)[None]
    new_bias = torch.zeros(b, 1, m, m, dtype=q.dtype, device=q.device).masked_fill(~allowed[:, None], neg)

    keys.append(k_new)
    values.append(v_new)
    if biases:
        past = torch.cat(biases, dim=-1)  # [b, h, Lp]
        mask = torch.cat([past[:, :, None, :].expand(-1, -1, m, -1), new_bias.expand(b, hkv, m, m)], dim=-1)
    else:
        mask = new_bias.expand(b, hkv, m, m)
    group = q.shape[1] // hkv
    if group > 1:
        mask = mask.repeat_interleave(group, dim=1)  # [b, Hq, m, L]
    K = torch.cat(keys, dim=-2) if len(keys) > 1 else keys[0]
    V = torch.cat(values, dim=-2) if len(values) > 1 else values[0]
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scaling, enable_gqa=group > 1)


def _entry_bias(counts: torch.Tensor, use: torch.Tensor, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """Additive logit bias of fused entries. counts: [b, n]; use: [b, h, n] or [n] -> [b, h, n].

    `log_size` gives an entry standing for s tokens log(s) extra logit (proportional
    attention, as in token merging), so it can carry the mass of the tokens it replaces.
    """
    c = counts[:, None, :].to(torch.float32)
    bias = c.clamp_min(1).log() if rule == "log_size" else torch.zeros_like(c)
    keep = use & (counts[:, None, :] > 0)
    return bias.masked_fill(~keep, float("-inf")).to(dtype)


def _gather_working_set(layer: FlashLayer, idx: torch.Tensor, block_tokens_valid: torch.Tensor) -> None:
    """Bring the selected blocks' exact K/V to the device. idx: [b, h, k] sorted.

    Reused as is when the selection did not change since the last step.
    """
    prev = layer.ws_idx
    if prev is not None and prev.shape == idx.shape and torch.equal(prev, idx):
        return
    b, h, k = idx.shape
    bi = torch.arange(b, device=idx.device)[:, None, None]
    hi = torch.arange(h, device=idx.device)[None, :, None]
    B = layer.cfg.hca_chunk_size
    # A (row, head) keeps the blocks it already holds; only the rest is fetched.
    if prev is not None and prev.shape[:2] == idx.shape[:2]:
        match = idx[..., :, None] == prev[..., None, :]  # [b, h, k, k_prev]
        held = match.any(-1)
        src = match.to(torch.int8).argmax(-1)
    else:
        held = torch.zeros_like(idx, dtype=torch.bool)
        src = torch.zeros_like(idx)
    need = torch.unique(idx[~held])
    if need.numel():
        blocks = [layer.fetch_block(int(j)) for j in need.tolist()]
        pool_k = torch.stack([bk for bk, _ in blocks])  # [u, b, h, B, d]
        pool_v = torch.stack([bv for _, bv in blocks])
        slot = torch.searchsorted(need, idx).clamp_max(need.numel() - 1)  # [b, h, k]
        new_k, new_v = pool_k[slot, bi, hi], pool_v[slot, bi, hi]  # [b, h, k, B, d]
    if held.any():
        d = layer.ws_k.shape[-1]
        old_k = layer.ws_k.view(b, h, -1, B, d)[bi, hi, src]  # [b, h, k, B, d]
        old_v = layer.ws_v.view(b, h, -1, B, d)[bi, hi, src]
        if need.numel():
            keep = held[..., None, None]
            new_k, new_v = torch.where(keep, old_k, new_k), torch.where(keep, old_v, new_v)
        else:
            new_k, new_v = old_k, old_v
    d = new_k.shape[-1]
    layer.ws_k = new_k.reshape(b, h, k * B, d)
    layer.ws_v = new_v.reshape(b, h, k * B, d)
    layer.ws_valid = block_tokens_valid[bi, idx].reshape(b, h, k * B)
    layer.ws_idx = idx

