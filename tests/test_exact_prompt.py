"""An exact prompt (`prefill_exact_tokens`): the prompt attended as the full cache attends
it, selection from the first generated token, the prompt's K/V dropped then."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import flashmem
from flashmem.errors import ConfigError
from test_cache import SMALL, reference, run
from tiny_models import MODELS, tiny_llama

# few pages selected: a prompt attended by its selection differs from the full cache's
SPARSE = dict(SMALL, lsa_top_k=1)


def _prompt_logits(model, cache, ids, mask=None):
    pos = None if mask is None else (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("codec", ["exact", "int8"])  # exact: streamed from the tiers; int8: a held buffer
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_an_exact_prompt_equals_the_full_caches_and_the_selection_starts_after_it(arch, codec):
    model = MODELS[arch]()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    ref = _prompt_logits(model, DynamicCache(config=model.config), ids)
    sparse = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE))
    assert (_prompt_logits(model, sparse, ids) - ref).abs().max() > 1e-2  # selection alone differs
    cfg = flashmem.FlashMemoryConfig(**SPARSE, prefill_exact_tokens=4096, cold_codec=codec)
    cache = flashmem.attach(model, cfg)
    assert (_prompt_logits(model, cache, ids) - ref).abs().max() <= 1e-4  # every position
    held = cache.memory_report()["tiers"]["prefill_kv"]
    assert cache.memory_report()["sealed_blocks"] > 0  # the tiers filled as usual
    if codec == "exact":  # streamed: nothing of the prompt held beyond the tiers
        assert held == 0
        assert (
            cache.memory_report()["peak_managed_resident_bytes"]
            <= sparse.memory_report()["peak_managed_resident_bytes"]
        )
        assert cache.traffic_report()["totals"]["h2d_bytes"] > 0  # the sealed blocks were read back
    else:  # a lossy cold tier: the prompt's K/V held on the device until the first generated token
        assert held > 0 and cache.memory_report()["peak_managed_resident_bytes"] >= held
    with torch.no_grad():  # the first generated token: selection, the prompt's K/V dropped
        model(torch.tensor([[5]]), cache=cache, use_cache=True)
    assert cache.memory_report()["tiers"]["prefill_kv"] == 0
    resident = sparse.memory_report()["managed_resident_bytes"]
    with torch.no_grad():
        model(torch.tensor([[5]]), cache=sparse, use_cache=True)
    if codec == "exact":
        assert cache.memory_report()["managed_resident_bytes"] == sparse.memory_report()["managed_resident_bytes"]
    assert resident > 0


def _buffered(monkeypatch):
    """The exact prompt as before streaming: the prompt's K/V held in a device buffer."""
    from flashmem.cache import exact_prompt, flash_layer

    monkeypatch.setattr(flash_layer, "ExactPrompt", lambda cap, streamed: exact_prompt.ExactPrompt(cap, False))


@pytest.mark.parametrize("chunk", [16, 64, 100])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_the_streamed_prompt_equals_the_buffered_one_at_every_chunk_size_with_padding(monkeypatch, arch, chunk):
    """The prompt read back from the tiers (sealed blocks from the cold tier in runs, merged by
    an online softmax) gives the logits of the prompt held on the device, for several chunk
    sizes, padded rows included, and decoding after it goes on the same."""
    model = MODELS[arch]()
    ids = torch.randint(0, 128, (2, 260), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    cfg = flashmem.FlashMemoryConfig(**dict(SPARSE, prefill_chunk=chunk), prefill_exact_tokens=4096)
    streamed = run(model, flashmem.attach(model, cfg), ids, 6, mask)
    _buffered(monkeypatch)
    held = run(model, flashmem.attach(model, cfg), ids, 6, mask)
    assert (streamed - held).abs().max() <= 1e-4


def test_the_streamed_runs_shrink_under_the_score_budget_with_the_same_logits(monkeypatch):
    """A run's scores stay under STREAM_SCORE_BYTES whatever the chunk: with a budget of one
    block's scores the runs are single blocks, the logits are the same, and the largest
    transient is smaller than with chunk-sized runs."""
    from flashmem.cache import exact_prompt

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 640), generator=torch.Generator().manual_seed(8))
    # forwards of 32 tokens; runs sized for a 512-token chunk: 16x the forward's own part
    cfg = flashmem.FlashMemoryConfig(**dict(SPARSE, prefill_chunk=512), prefill_exact_tokens=4096)
    wide = flashmem.attach(model, cfg)
    ref = flashmem.prefill(model, wide, ids, chunk=32)
    monkeypatch.setattr(exact_prompt, "STREAM_SCORE_BYTES", 1)  # one block per run
    narrow = flashmem.attach(model, cfg)
    got = flashmem.prefill(model, narrow, ids, chunk=32)
    assert (got - ref).abs().max() <= 1e-4
    assert 0 < narrow.memory_report()["prompt_stream_bytes"] < wide.memory_report()["prompt_stream_bytes"]
    # padded rows (a part where a row sees nothing) and decoding after: the same
    ids2 = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids2)
    mask[1, :37] = 0
    cfg2 = flashmem.FlashMemoryConfig(**dict(SPARSE, prefill_chunk=64), prefill_exact_tokens=4096)
    got2 = run(model, flashmem.attach(model, cfg2), ids2, 4, mask)
    monkeypatch.undo()
    ref2 = run(model, flashmem.attach(model, cfg2), ids2, 4, mask)
    assert (got2 - ref2).abs().max() <= 1e-4


@pytest.mark.parametrize("rest", [False, True])
def test_a_chunk_attends_its_selection_in_query_slices_under_the_mask_budget(monkeypatch, rest):
    """A prompt chunk that attends its selection (no exact prompt) builds a [b, Hq, m, L] mask;
    past MASK_BYTES its queries attend in slices with the same logits, padding and the rest
    entry included."""
    from flashmem.cache import assembly

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, :21] = 0
    keys = dict(SPARSE, prefill_chunk=100, prefill_exact_tokens=0)
    if rest:
        keys.update(use_summaries=False, rest_entry=True)
    cfg = flashmem.FlashMemoryConfig(**keys)
    ref = run(model, flashmem.attach(model, cfg), ids, 4, mask)
    monkeypatch.setattr(assembly, "MASK_BYTES", 1)  # one query per slice
    got = run(model, flashmem.attach(model, cfg), ids, 4, mask)
    assert (got - ref).abs().max() <= 1e-4


def test_a_streamed_prompt_reads_the_cold_tier_once_per_chunk_and_layer():
    """Traffic of a streamed prompt: each chunk after the first reads every block sealed before
    it, once per managed layer, from the cold tier (h2d_bytes), and nothing is held."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(9))
    kw = dict(SPARSE, prefill_chunk=64, prefill_split_tail=False, gpu_cache_limit=16, sink_tokens=4)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**kw, prefill_exact_tokens=4096))
    _prompt_logits(model, cache, ids)
    B, layers = kw["hca_chunk_size"], len(cache.flash_layers)
    per_token = 2 * cache.flash_layers[0].sink_k.shape[1] * cache.flash_layers[0].sink_k.shape[-1] * 4
    # blocks sealed before each chunk starts: after c chunks of 64, (64 c - sinks - window) // B
    sealed_before = [max(0, (64 * c - 4 - 16) // B) for c in range(4)]
    expected = sum(n * B * per_token for n in sealed_before) * layers
    assert cache.traffic_report()["totals"]["h2d_bytes"] == expected
    assert cache.memory_report()["tiers"]["prefill_kv"] == 0


def test_padded_batches_and_decoding_after_an_exact_prompt_match_the_full_cache_when_all_fits():
    """Left padding is hidden in the exact prompt too; with every page selected the steps
    after it are exact as well."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    ref = reference(model, ids, 6, mask)
    cfg = flashmem.FlashMemoryConfig(**SMALL, lsa_keep_ratio=1.0, prefill_exact_tokens=1000)
    out = run(model, flashmem.attach(model, cfg), ids, 6, mask)
    assert (out - ref).abs().max() <= 1e-4


def test_a_prompt_past_the_cap_goes_on_by_selection_and_drops_the_prompts_kv():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("sdpa")
    full = DynamicCache(config=model.config)
    cfg = flashmem.FlashMemoryConfig(**SPARSE, prefill_exact_tokens=250, cold_codec="int8")  # held
    cache = flashmem.attach(model, cfg)
    for a in (0, 100):  # within the cap: exact, the prompt's K/V kept
        ref = _prompt_logits(model, full, ids[:, a : a + 100])
        assert (_prompt_logits(model, cache, ids[:, a : a + 100]) - ref).abs().max() <= 1e-4
        assert cache.memory_report()["tiers"]["prefill_kv"] > 0
    ref = _prompt_logits(model, full, ids[:, 200:])
    assert (_prompt_logits(model, cache, ids[:, 200:]) - ref).abs().max() > 1e-2  # past it: selection
    assert cache.memory_report()["tiers"]["prefill_kv"] == 0
    # and it stays so: a later prompt forward within the cap would not be exact (tokens are missing)
    assert not any(layer.exact_prompt(2) for layer in cache.flash_layers)


def test_an_exact_prompt_with_window_positions_is_a_one_line_error():
    with pytest.raises(ConfigError, match="prefill_exact_tokens") as err:
        flashmem.FlashMemoryConfig(position_mode="window", use_summaries=False, prefill_exact_tokens=1024)
    assert "\n" not in str(err.value)


def test_a_one_shot_prompt_holds_exactly_its_kv_and_a_fed_one_never_more_than_the_cap():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(5))
    per_token = sum(  # K and V of one token, every managed layer
        2 * layer.k_proj.out_features * 4 for layer in (blk.self_attn for blk in model.model.layers)
    )
    held = dict(SPARSE, cold_codec="int8")  # a lossy cold tier: the prompt is held, not streamed
    one = flashmem.attach(model, flashmem.FlashMemoryConfig(**held, prefill_exact_tokens=4096))
    _prompt_logits(model, one, ids)
    assert one.memory_report()["tiers"]["prefill_kv"] == 300 * per_token
    fed = flashmem.attach(model, flashmem.FlashMemoryConfig(**held, prefill_exact_tokens=310))
    for a in range(0, 300, 30):
        _prompt_logits(model, fed, ids[:, a : a + 30])
        assert fed.memory_report()["tiers"]["prefill_kv"] <= 310 * per_token
    assert fed.memory_report()["tiers"]["prefill_kv"] >= 300 * per_token


def test_parts_seen_alike_take_the_fused_kernel_and_merge_as_the_scores_do(monkeypatch):
    """OnlineSoftmax: parts every query sees alike (one with a masked key, one that row 1 of
    the batch does not see at all) and the queries' own causal keys (`add_causal`) go through
    PyTorch's fused CPU kernel; the merged attention equals one softmax over every key, and
    the scores' way for every part."""
    import math

    from flashmem.cache import exact_prompt

    g = torch.Generator().manual_seed(3)
    b, hkv, group, m, d = 2, 2, 3, 5, 8
    q = torch.randn(b, hkv * group, m, d, generator=g)
    parts = [(torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)) for n in (4, 7, m)]
    seen = [torch.ones(b, 1, 4, dtype=torch.bool), torch.ones(b, 1, 7, dtype=torch.bool)]
    seen[0][0, 0, 2] = False  # one key hidden from row 0
    seen[1][1] = False  # row 1 sees none of the second part
    seen.append(torch.ones(m, m, dtype=torch.bool).tril().expand(b, m, m))  # the chunk itself, causal
    calls = []
    real = exact_prompt.FLASH_CPU
    monkeypatch.setattr(exact_prompt, "FLASH_CPU", lambda *a, **k: calls.append(1) or real(*a, **k))

    def attend(fused: bool) -> torch.Tensor:
        acc = exact_prompt.OnlineSoftmax(q, hkv, 0.3)
        acc.fused = fused
        for (k, v), s in zip(parts[:2], seen):
            acc.add(k, v, s)
        acc.add_causal(*parts[2])
        return acc.result(q.dtype)

    got = attend(True)
    assert len(calls) == 3
    K = torch.cat([k for k, _ in parts], -2).repeat_interleave(group, 1)
    V = torch.cat([v for _, v in parts], -2).repeat_interleave(group, 1)
    allowed = torch.cat([s.expand(b, m, s.shape[-1]) for s in seen], -1)[:, None]
    logits = (q @ K.transpose(-1, -2) * 0.3).masked_fill(~allowed, -math.inf)
    want = torch.softmax(logits, -1) @ V
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got, attend(False), atol=1e-5)


def test_a_streamed_prompt_forward_reads_each_sealed_block_once():
    """A prompt fed in forwards (as the server and the harness feed it) streams the cold tier
    once per forward: the tail's queries are not split off into chunks of their own (they select
    nothing), so each forward copies exactly the blocks sealed before it (by hand: blocks x B
    tokens x 2 KV heads x 16 dims x K and V x 4 bytes, per layer)."""
    model = tiny_llama()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, prefill_exact_tokens=4096))
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    block_bytes = SPARSE["hca_chunk_size"] * 2 * 16 * 2 * 4
    with torch.no_grad():
        for s in range(0, 300, 37):
            sealed = [layer.num_sealed if layer.is_initialized else 0 for layer in cache.flash_layers]
            before = cache.traffic_report()["totals"]["h2d_bytes"]
            model(ids[:, s : s + 37], cache=cache, use_cache=True)
            assert cache.traffic_report()["totals"]["h2d_bytes"] - before == sum(sealed) * block_bytes
    assert sum(sealed) > 0
