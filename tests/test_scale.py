"""Long inputs: model-level chunked prefill, and nothing per decode step that grows
with the whole context (tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache import attention
from tiny_models import tiny_llama

SMALL = dict(
    gpu_cache_limit=16, sink_tokens=2, hca_chunk_size=16, csa_chunk_size=4, csa_band_tokens=32, prefill_chunk=37
)


def decode(model, cache, first, steps):
    """Greedy-free fixed token stream after the prompt -> logits [steps, vocab]."""
    outs, tok = [first[:, -1]], torch.full((1, 1), 5)
    with torch.no_grad():
        for _ in range(steps):
            outs.append(model(tok, cache=cache, use_cache=True).logits[:, -1])
            tok = (tok * 7 + 3) % 128
    return torch.cat(outs)


@pytest.mark.parametrize("chunk", [80, 200])
def test_model_level_chunked_prefill_equals_one_shot(chunk):
    # Blocks are left out (top-1 of many), so this holds only if every chunk's queries pool
    # the same selections as the one-shot forward's.
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    cfg = flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=1)
    one = flashmem.attach(model, cfg)
    with torch.no_grad():
        ref = decode(model, one, model(ids, cache=one, use_cache=True).logits, 6)
    many = flashmem.attach(model, cfg)
    got = decode(model, many, flashmem.prefill(model, many, ids, chunk=chunk), 6)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert many.get_seq_length() == one.get_seq_length() == 306


def test_prefill_rejects_a_bad_chunk():
    model = tiny_llama(layers=1)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL))
    with pytest.raises(ValueError, match="chunk"):
        flashmem.prefill(model, cache, torch.zeros(1, 4, dtype=torch.long), chunk=0)


def step_sizes(model, cache, monkeypatch):
    """One decode step: (mask shape transformers passed to attention, keys attended) per layer."""
    seen: list[tuple[tuple[int, ...], int]] = []
    real_step, real_sdpa = attention._layer_step, torch.nn.functional.scaled_dot_product_attention
    masks: list[tuple[int, ...]] = []

    def spy_step(layer, pending, query, mask, scaling):
        masks.append(tuple(mask.shape) if mask is not None else ())
        return real_step(layer, pending, query, mask, scaling)

    def spy_sdpa(q, k, v, **kw):
        seen.append((masks[-1], k.shape[-2]))
        return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention, "_layer_step", spy_step)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
    with torch.no_grad():
        model(torch.full((1, 1), 5), cache=cache, use_cache=True)
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("summaries", [False, True])
def test_per_step_keys_and_mask_do_not_grow_with_context(summaries, monkeypatch):
    model = tiny_llama(layers=2)
    cfg = flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=2, use_summaries=summaries)
    sizes, blocks = [], []
    for n in (300, 300 + 16 * 57):  # same open-block fill at both lengths
        ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(0))
        cache = flashmem.attach(model, cfg)
        flashmem.prefill(model, cache, ids, chunk=256)
        # the step after n tokens: the sealed blocks are what they will be during the step
        blocks.append(cache.flash_layers[0].num_sealed)
        assert cache.get_mask_sizes(1, 0) == (1, n)  # (kv_length, kv_offset) of the mask to build
        sizes.append(step_sizes(model, cache, monkeypatch))
    short, long = sizes
    assert len(short) == len(long) == 2  # one attention call per layer
    for (mask_s, keys_s), (mask_l, keys_l) in zip(short, long):
        # transformers builds the mask over the new token only (here it can skip it: None)
        assert mask_s == mask_l and mask_s in ((), (1, 1, 1, 1))
        # Without summaries the attended keys are sinks + selected + open block + window,
        # whatever the context; with them, one HCA entry per far block is added.
        far_growth = blocks[1] - blocks[0] if summaries else 0
        assert keys_l - keys_s == far_growth
    assert blocks[1] > 3 * blocks[0]


WINDOW = dict(SMALL, position_mode="window", use_summaries=False)


def prompt_and_steps(model, cfg, n=200, steps=6):
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(2))
    cache = flashmem.attach(model, cfg)
    return decode(model, cache, flashmem.prefill(model, cache, ids), steps)


@pytest.mark.parametrize(
    "fits",
    [dict(gpu_cache_limit=4096), dict(lsa_keep_ratio=1.0)],
    ids=["all-in-window", "all-blocks-selected"],
)
def test_window_positions_are_exact_when_everything_is_attended(fits):
    # Every token attended, in order: window positions are the real ones, so the
    # logits must equal real positions' (which equal DynamicCache's, tests/test_cache.py).
    model = tiny_llama(layers=2)
    real = prompt_and_steps(model, flashmem.FlashMemoryConfig(**{**WINDOW, **fits, "position_mode": "real"}))
    window = prompt_and_steps(model, flashmem.FlashMemoryConfig(**{**WINDOW, **fits}))
    torch.testing.assert_close(window, real, atol=1e-5, rtol=1e-5)


def test_window_positions_move_blocks_when_some_are_left_out():
    model = tiny_llama(layers=2)
    real = prompt_and_steps(model, flashmem.FlashMemoryConfig(**{**WINDOW, "lsa_top_k": 2, "position_mode": "real"}))
    window = prompt_and_steps(model, flashmem.FlashMemoryConfig(**{**WINDOW, "lsa_top_k": 2}))
    assert (window - real).abs().max() > 1e-3


def test_window_positions_need_summaries_off():
    with pytest.raises(flashmem.ConfigError, match="position_mode: window.*allowed: window with use_summaries: false"):
        flashmem.FlashMemoryConfig(position_mode="window")
    with pytest.raises(flashmem.ConfigError, match="position_mode"):
        flashmem.FlashMemoryConfig(position_mode="true", use_summaries=False)
