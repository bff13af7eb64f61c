"""Model-level chunked prefill: feed a long prompt to the model a chunk at a time.

One forward over a whole prompt makes transformers allocate activations for
every token at once (hidden states, MLP intermediates, logits, RoPE tables):
memory that grows with the prompt even though the cache itself is bounded.
`prefill` feeds `chunk` tokens per forward instead, so peak memory is set by
the chunk, not the prompt. The cache sees the same tokens in the same order,
so the result equals one forward over the whole prompt (tests/test_scale.py).
At the end the cache is told the prompt is in (`FlashMemoryCache.prompt_done`: attention's
prompt-sized buffers dropped and, with a cold tier off RAM, the C heap's free pages
handed back to the OS).
"""

from __future__ import annotations

from typing import Any

import torch

from flashmem.cache.flash_layer import FlashLayer

DEFAULT_CHUNK = 8192


def prefill(
    model: Any,
    cache: Any,
    input_ids: torch.Tensor,
    *,
    chunk: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `input_ids` [b, n] through `model` into `cache` in forwards of `chunk` tokens.

    chunk None: DEFAULT_CHUNK, or the cache's `prefill_chunk` where its cold tier is off RAM
    (disk): there RAM is what the budget saves, and a forward's activations are most of the
    prompt's peak RSS (SmolLM2 at 8K and 1/8: 8.35x the budget with 8K-token forwards, 4.06x
    with 512-token ones; the tiny model at 64K: 9.05x and 5.07x; at 0.95-1.08x the prefill
    time: docs/results.md, "The process's RAM with a disk cold tier").

    attention_mask: the 2D padding mask [b, n] of the prompt (None: no padding).
    A chunk longer than the cache's `prefill_chunk` is cut to a multiple of it, and only
    the last forward splits off the prompt's tail (`prefill_split_tail`), so the cache
    ends in the state one forward over the whole prompt leaves. Returns the logits of the prompt's last position, [b, 1, vocab], as
    `model(input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits`."""
    cfg = getattr(cache, "cfg", None)
    step = chunk if chunk is not None else DEFAULT_CHUNK
    if chunk is None and cfg is not None and getattr(cfg, "cold_store", "memory") != "memory":
        step = int(cfg.prefill_chunk)  # a cold tier off RAM: a forward's activations bound the RSS
    if step < 1:
        raise ValueError(f"chunk: {step}; allowed: a positive number of tokens")
    n = int(input_ids.shape[1])
    if n == 0:
        raise ValueError("input_ids: empty prompt; allowed: at least one token")
    layers = [layer for layer in getattr(cache, "layers", []) if isinstance(layer, FlashLayer)]
    if cfg is not None and step > cfg.prefill_chunk:
        # whole internal chunks: the cache then pools the same queries per selection as one forward would
        step -= step % cfg.prefill_chunk
    past = cache.get_seq_length()
    if attention_mask is not None and past:
        # transformers reads the 2D mask over every position seen so far: earlier tokens are real
        ones = torch.ones(attention_mask.shape[0], past, dtype=attention_mask.dtype, device=attention_mask.device)
        attention_mask = torch.cat([ones, attention_mask], dim=-1)
    logits = None
    with torch.no_grad():
        for a in range(0, n, step):
            e = min(n, a + step)
            kwargs: dict[str, Any] = {}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask[:, : past + e]
            for layer in layers:  # only the prompt's real tail selects on its own (prefill_split_tail)
                layer.mid_prompt = e < n
            try:
                out = model(input_ids[:, a:e], cache=cache, use_cache=True, logits_to_keep=1, **kwargs)
            finally:
                for layer in layers:
                    layer.mid_prompt = False
            logits = out.logits
    assert logits is not None
    done = getattr(cache, "prompt_done", None)
    if done is not None:  # attention's prompt-sized buffers dropped, the heap handed back (FlashMemoryCache)
        done()
    return logits
