"""The attention function flashmem registers with transformers: a thin adapter.

transformers calls it per attention layer; it finds the layer's FlashLayer (the
key tensor `FlashLayer.update` returned carries it: the attention function is
not handed the cache), reads which new tokens are padding from the mask, splits
the queries into chunks and lets the layer run each chunk's step (select,
gather, attend, append: `FlashLayer.step`). Long prompts run in chunks of
`prefill_chunk` queries, so the cache never holds more than its budget.

Layers that flashmem does not manage (full layers, sliding-window layers) fall
through to transformers' SDPA attention unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flashmem.cache.flash_layer import FlashLayer

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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [b, Hq, q, d]; key/value: what `cache.update` returned -> out [b, q, Hq, d]."""
    rows = getattr(key, "_flashmem_rows", None)
    if rows is not None:  # a BatchedCache: each row attends over its own cache (cache/batched.py)
        from flashmem.cache.batched import rows_attention

        return rows_attention(module, query, rows, scaling, dropout, **kwargs)
    layer: FlashLayer | None = getattr(key, "_flashmem_layer", None)
    pending = layer.take_pending() if layer is not None else None
    if layer is None or pending is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    try:
        return _layer_step(layer, pending, query, attention_mask, scaling)
    except BaseException as exc:
        if layer.guard is not None:  # the layers before this one took the step, the rest did not
            layer.guard.fail(exc)
        raise


def _layer_step(
    layer: FlashLayer,
    pending: tuple[torch.Tensor, torch.Tensor],
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    k_new, v_new = pending
    b, _, q, d = query.shape
    scaling = d**-0.5 if scaling is None else scaling
    valid_new = _new_token_validity(attention_mask, b, q, query.device)
    exact = layer.exact_prompt(q) or layer.exact_redo  # the prompt, or a step redone on doubt
    layer.forward_exact = exact
    layer.decoding |= q == 1
    if not exact and layer.decoding and 1 < q <= layer.cfg.select_per_token_max:
        # a verify forward after the prompt: each token selects, attends and appends as a
        # one-token step would (copied out at once: a graph step's output is its buffer)
        out = query.new_empty(query.shape)
        for i in range(q):
            one = slice(i, i + 1)
            out[:, :, one] = layer.step(
                query[:, :, one], k_new[:, :, one], v_new[:, :, one], valid_new[:, one], scaling
            )
        return out.transpose(1, 2).contiguous(), None
    # the tail splits off to select on its own (TAIL_QUERIES); an exact forward (the prompt, a
    # redo) selects nothing, and each chunk would stream every earlier token again
    split = layer.cfg.prefill_split_tail and not layer.mid_prompt and not exact
    outs = [
        layer.step(query[:, :, a:e], k_new[:, :, a:e], v_new[:, :, a:e], valid_new[:, a:e], scaling, exact)
        for a, e in query_chunks(q, layer.cfg.prefill_chunk, split)
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


# The last queries of a prompt (the question) select their own blocks instead of
# sharing a whole chunk's pooled choice, and the very last query, whose logits
# emit the first generated token, selects alone, as every decode step does:
# pooled with the question's earlier words ("What is the ...") the block it
# needs can be outvoted (on an 8K Gemma3-270m passkey prompt the last query
# alone picked the needle's block in a layer where the pooled question did not).
TAIL_QUERIES = 32


def query_chunks(q: int, step: int, split_tail: bool = True) -> list[tuple[int, int]]:
    """Query ranges [a, e): chunks of `step`; with split_tail the last TAIL_QUERIES
    split off, then the last query on its own (config `prefill_split_tail`)."""
    bounds = list(range(0, q, step)) + [q]
    if split_tail and q > 1 and bounds[-1] - bounds[-2] > TAIL_QUERIES:
        bounds.insert(-1, q - TAIL_QUERIES)
    if split_tail and q > 1 and bounds[-1] - bounds[-2] > 1:
        bounds.insert(-1, q - 1)
    return list(zip(bounds[:-1], bounds[1:]))


def _new_token_validity(mask: torch.Tensor | None, b: int, q: int, device: torch.device) -> torch.Tensor:
    """[b, q] True where a new token is real (not padding).

    The new tokens are the mask's last q columns, whether it spans every position
    or only them (FlashLayer.get_mask_sizes); its last query row sees all of them
    causally, so a False there is padding.
    """
    if mask is None:
        return torch.ones(b, q, dtype=torch.bool, device=device)
    row = mask[:, 0, -1, mask.shape[-1] - q :]
    if row.dtype != torch.bool:  # additive float mask
        row = row == 0
    return row.expand(b, q).to(device)
