"""The FlashMemory cache inside real transformers models (tiny random weights).

Exactness is the anchor: when every token is either resident or selected
exactly, flashmem must reproduce DynamicCache's logits; any slip in gathering,
ordering, masking or positions shows up as a difference.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import flashmem
from flashmem import policies
from flashmem.cache.flash_layer import FlashLayer
from flashmem.errors import ConfigError
from flashmem.sizing.tiers import tier_counts
from tiny_models import MODELS, tiny_gemma3, tiny_llama

SMALL = dict(
    gpu_cache_limit=16,
    sink_tokens=2,
    hca_chunk_size=16,
    csa_chunk_size=4,
    csa_band_tokens=32,
    prefill_chunk=37,
)
ALL_EXACT = dict(SMALL, lsa_keep_ratio=1.0)


def run(model, cache, ids, steps, mask=None):
    """Prefill then `steps` decode steps on a fixed token stream -> logits [b, steps+1, vocab]."""
    outs = []
    pos = None if mask is None else (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True, attention_mask=mask, position_ids=pos)
        outs.append(out.logits[:, -1])
        tok = torch.full((ids.shape[0], 1), 5)
        for _ in range(steps):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(tok)], -1)
                pos = pos[:, -1:] + 1
            out = model(tok, cache=cache, use_cache=True, attention_mask=mask, position_ids=pos)
            outs.append(out.logits[:, -1])
            tok = (tok * 7 + 3) % 128
    return torch.stack(outs, 1)


def reference(model, ids, steps, mask=None):
    model.set_attn_implementation("sdpa")
    return run(model, DynamicCache(config=model.config), ids, steps, mask)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_large_window_equals_dynamic_cache(arch):
    model = MODELS[arch]()
    ids = torch.randint(0, 128, (1, 200))
    ref = reference(model, ids, 64)
    cache = flashmem.attach(model, gpu_cache_limit=4096)
    out = run(model, cache, ids, 64)
    assert (out - ref).abs().max() <= 1e-4
    assert cache.get_seq_length() == 200 + 64


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_small_window_all_blocks_selected_equals_dynamic_cache(arch):
    model = MODELS[arch]()
    ids = torch.randint(0, 128, (1, 200))
    ref = reference(model, ids, 64)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**ALL_EXACT))
    out = run(model, cache, ids, 64)
    assert (out - ref).abs().max() <= 1e-4
    report = cache.memory_report()
    assert report["sealed_blocks"] > 0 and report["tiers"]["working_set"] > 0
    assert report["cold_bytes"] > 0


def test_compression_changes_logits_when_blocks_are_left_out():
    """The equality above is not vacuous: with few blocks selected the output differs."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    ref = reference(model, ids, 8)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=1))
    out = run(model, cache, ids, 8)
    assert (out - ref).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_prefill_equals_one_shot(chunk):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 150))
    ref = reference(model, ids, 4)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**{**ALL_EXACT, "prefill_chunk": chunk}))
    out = run(model, cache, ids, 4)
    assert (out - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_left_padded_batch_equals_sequences_alone(arch):
    model = MODELS[arch]()
    a, b = torch.randint(0, 128, (1, 150)), torch.randint(0, 128, (1, 97))
    cfg = flashmem.FlashMemoryConfig(**ALL_EXACT)
    alone_a = run(model, flashmem.attach(model, cfg), a, 20, torch.ones_like(a))
    alone_b = run(model, flashmem.attach(model, cfg), b, 20, torch.ones_like(b))
    pad = a.shape[1] - b.shape[1]
    ids = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    both = run(model, flashmem.attach(model, cfg), ids, 20, mask)
    assert (both[0] - alone_a[0]).abs().max() <= 1e-4
    assert (both[1] - alone_b[0]).abs().max() <= 1e-4


def test_positions_stay_true_after_the_window_wraps_many_times():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40))
    ref = reference(model, ids, 300)  # the window (16) wraps ~20 times during decode
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**ALL_EXACT))
    out = run(model, cache, ids, 300)
    assert cache.get_seq_length() == 340
    assert (out - ref).abs().max() <= 1e-4


def test_generate_works_with_cache_and_deprecated_alias():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 60))
    outs = []
    for kw in ("cache", "past_key_values"):
        cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**ALL_EXACT))
        outs.append(model.generate(ids, **{kw: cache}, max_new_tokens=12, do_sample=False))
        assert cache.get_seq_length() == 60 + 12 - 1
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)


def test_peak_resident_bytes_stay_under_budget_on_long_prefill():
    """8K-token prefill, 1K window: measured peak stays within the configured budget."""
    model = tiny_llama(layers=2)
    cfg = flashmem.FlashMemoryConfig(
        gpu_cache_limit=1024, sink_tokens=4, csa_band_tokens=1024, lsa_top_k=4, prefill_chunk=512
    )
    cache = flashmem.attach(model, cfg)
    ids = torch.randint(0, 128, (1, 8192))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    report = cache.memory_report()
    layer = cache.flash_layers[0]
    per_token = (
        2 * layer.summaries.hca_k.shape[1] * layer.summaries.hca_k.shape[-1] * layer.summaries.hca_k.element_size()
    )
    counts = tier_counts(cfg, 8192)
    budget_per_layer = per_token * (counts.resident_kv + 512) + per_token // 2 * counts.index_key_vectors
    full_cache = per_token * 8192 * 2
    assert report["peak_managed_resident_bytes"] <= 2 * budget_per_layer * 1.05
    assert report["peak_managed_resident_bytes"] < full_cache / 3
    assert report["cold_bytes"] >= per_token * counts.cold_tokens * 2


def test_memory_report_matches_tier_arithmetic():
    model = tiny_llama(layers=2)
    cfg = flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=2)
    cache = flashmem.attach(model, cfg)
    run(model, cache, torch.randint(0, 128, (1, 300)), 3)
    counts = tier_counts(cfg, cache.get_seq_length())
    tiers = cache.memory_report()["tiers"]
    per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, fp32
    layers = 2
    assert tiers["window"] == layers * per_token * counts.window
    assert tiers["sinks"] == layers * per_token * counts.sinks
    assert tiers["hca_entries"] == layers * per_token * counts.hca_entries
    assert tiers["csa_entries"] == layers * per_token * counts.csa_entries
    assert tiers["working_set"] == layers * per_token * counts.working_set
    assert tiers["index"] == layers * per_token // 2 * counts.index_key_vectors


@pytest.mark.parametrize("spec,expected", [([0], {0}), ([-1], {2}), ([0, -1], {0, 2})])
def test_keep_full_layers_hold_a_plain_full_cache(spec, expected):
    model = tiny_llama(layers=3)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, keep_full_layers=spec))
    run(model, cache, torch.randint(0, 128, (1, 120)), 2)
    full = {i for i, layer in enumerate(cache.layers) if type(layer) is DynamicLayer}
    assert full == expected
    for i in full:
        assert cache.layers[i].keys.shape[-2] == 122
    assert all(isinstance(cache.layers[i], FlashLayer) for i in set(range(3)) - expected)


def test_keep_full_layers_outside_the_model_is_a_config_error():
    with pytest.raises(ConfigError, match="outside the model's 2 layers"):
        flashmem.attach(tiny_llama(layers=2), keep_full_layers=[5])


def test_gemma3_sliding_layers_keep_their_own_bounded_cache():
    model = tiny_gemma3()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL))
    run(model, cache, torch.randint(0, 128, (1, 100)), 3)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, FlashLayer, DynamicSlidingWindowLayer, FlashLayer]
    assert cache.layers[0].keys.shape[-2] <= 16
    assert cache.memory_report()["sliding_layer_bytes"] > 0


@pytest.mark.parametrize("rule", sorted(policies.FUSION_RULES))
@pytest.mark.parametrize("scorer", sorted(n for n, s in policies.SCORERS.items() if not s.needs_calibration))
def test_every_fusion_rule_and_scorer_runs_and_stays_finite(rule, scorer):
    # calibrated scorers: tests/test_pages_calibration.py
    model = tiny_llama()
    cfg = flashmem.FlashMemoryConfig(**SMALL, fusion_rule=rule, lsa_scorer=scorer, lsa_top_k=1)
    out = run(model, flashmem.attach(model, cfg), torch.randint(0, 128, (1, 200)), 4)
    assert torch.isfinite(out).all()


def test_model_still_works_with_a_plain_cache_after_attach():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 50))
    with torch.no_grad():
        ref = model(ids).logits
        flashmem.attach(model)
        again = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits
    assert (again - ref).abs().max() <= 1e-5


def test_close_releases_the_cold_tier():
    model = tiny_llama()
    with flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL)) as cache:
        run(model, cache, torch.randint(0, 128, (1, 120)), 1)
        assert cache.memory_report()["cold_bytes"] > 0
    assert cache.store.nbytes() == 0


def test_working_set_reuse_matches_a_fresh_gather():
    """Blocks kept from the last step's working set are the same bytes the store holds."""
    model = tiny_llama()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=3))
    ids = torch.randint(0, 128, (1, 150))
    changed = 0
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        layer = cache.flash_layers[0]
        for t in range(40):
            before = None if layer.ws_idx is None else layer.ws_idx.clone()
            model(torch.tensor([[t % 128]]), cache=cache, use_cache=True)
            idx = layer.ws_idx
            changed += before is not None and before.shape == idx.shape and not torch.equal(before, idx)
            B = cache.cfg.hca_chunk_size
            for h in range(idx.shape[1]):
                for j, blk in enumerate(idx[0, h].tolist()):
                    k, v = cache.store.get((layer.layer_idx, blk))
                    assert torch.equal(layer.ws_k[0, h, j * B : (j + 1) * B], k[0, h])
                    assert torch.equal(layer.ws_v[0, h, j * B : (j + 1) * B], v[0, h])
    assert changed > 0  # the selection moved, so the reuse path ran


def test_query_chunks_split_off_the_question_and_the_last_query():
    from flashmem.cache.attention import TAIL_QUERIES
    from flashmem.cache.attention import query_chunks as _chunks

    assert _chunks(1, 512) == [(0, 1)]
    assert _chunks(12, 512) == [(0, 11), (11, 12)]  # a question: the answer's position alone
    q = 600
    assert _chunks(q, 512) == [(0, 512), (512, q - TAIL_QUERIES), (q - TAIL_QUERIES, q - 1), (q - 1, q)]
    spans = _chunks(2000, 256)
    assert spans[0][0] == 0 and spans[-1][1] == 2000
    assert all(a < e and e == spans[i + 1][0] for i, (a, e) in enumerate(spans[:-1]))


def test_plain_prefill_chunks_when_the_tail_is_not_split():
    from flashmem.cache.attention import query_chunks

    assert query_chunks(600, 512, split_tail=False) == [(0, 512), (512, 600)]
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 150))
    outs = []
    for split in (True, False):
        cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, prefill_split_tail=split))
        with torch.no_grad():
            outs.append(model(ids, cache=cache, use_cache=True).logits)
    assert torch.isfinite(outs[1]).all()
    assert not torch.equal(outs[0][0, -1], outs[1][0, -1])  # the last query selected alone, or not


def test_selection_hook_overrides_what_the_layers_attend():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 150))
    seen = []

    def first_blocks(layer_idx, idx, scores):
        seen.append((layer_idx, scores.shape[-1]))
        return torch.arange(idx.shape[-1]).expand_as(idx).contiguous()

    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL, lsa_top_k=2))
    cache.selection_hook = first_blocks
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(torch.tensor([[5]]), cache=cache, use_cache=True)
    assert seen and {i for i, _ in seen} == {layer.layer_idx for layer in cache.flash_layers}
    assert all(layer.ws_idx[0, :, :].tolist() == [[0, 1]] * layer.ws_idx.shape[1] for layer in cache.flash_layers)
