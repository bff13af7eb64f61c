"""`lsa_prefill_queries`: a prefill chunk's selection scored by a sample of its queries."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache.tiered_attention import sample_queries as _sample_queries
from flashmem.index.selection import select_blocks
from test_cache import ALL_EXACT, SMALL, reference, run
from tiny_models import MODELS, tiny_llama

torch.set_num_threads(1)


@pytest.mark.parametrize("m,n,group", [(10, 4, 2), (64, 8, 1), (37, 36, 3), (5, 1, 2)])
def test_sample_is_evenly_spaced_keeps_the_last_query_and_whole_groups(m, n, group):
    b, h, d = 2, 3, 4
    # row t*group + g of a KV head holds query position t of query head g (token-major)
    pos = torch.arange(m)[:, None].expand(m, group).reshape(-1).float()
    qg = pos[None, None, :, None].expand(b, h, m * group, d).clone()
    qg[..., 1] = torch.arange(group).repeat(m).float()  # which head of the group
    got = _sample_queries(qg, m, n)
    assert got.shape == (b, h, n * group, d)
    taken = got[0, 0, ::group, 0].long()
    assert taken[-1].item() == m - 1 and len(set(taken.tolist())) == n
    gaps = taken.diff()
    assert n == 1 or (gaps.min() >= 1 and gaps.max() - gaps.min() <= 1)  # evenly spaced
    assert torch.equal(got[0, 0, :, 1], torch.arange(group).repeat(n).float())  # every head of the group
    assert torch.equal(
        got[..., 0].view(b, h, n, group), got[..., 0].view(b, h, n, group)[..., :1].expand(-1, -1, -1, group)
    )


@pytest.mark.parametrize("n", [0, 10, 12])
def test_no_sample_when_off_or_the_chunk_is_not_longer(n):
    qg = torch.randn(1, 2, 10 * 2, 4)
    assert _sample_queries(qg, 10, n) is qg


def _selections(model, ids, **kw):
    seen = []
    cfg = flashmem.FlashMemoryConfig(**{**SMALL, "lsa_top_k": 2, **kw})
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        cache.selection_hook = lambda layer, idx, scores: seen.append((scores.shape[2], idx.clone())) or idx
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        for _ in range(3):
            out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
    return seen


def test_prefill_chunks_score_with_the_sample_and_decode_steps_with_their_query():
    model = tiny_llama()
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    full = _selections(model, ids, prefill_split_tail=False)
    sampled = _selections(model, ids, prefill_split_tail=False, lsa_prefill_queries=4)
    assert len(full) == len(sampled)
    rows_full = {r for r, _ in full}
    rows_sampled = sorted({r for r, _ in sampled})
    assert 37 * group in rows_full and 37 * group not in rows_sampled  # prefill_chunk is 37
    assert rows_sampled == [1 * group, 4 * group]  # decode steps; prefill chunks (and the short tail: 200 % 37 = 15)
    # a sample picks differently on some chunk: the option is not a no-op
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(full, sampled))


def test_sampled_selection_is_the_selection_of_the_sampled_queries():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(1, 2, 12, 9, generator=g)  # [b, h, m*group (group 2, m 6), pages]
    valid = torch.ones(1, 9, dtype=torch.bool)
    sub = _sample_queries(scores, 6, 3)
    rows = [2, 3, 6, 7, 10, 11]  # positions 1, 3, 5, each with both heads of the group
    assert torch.equal(select_blocks(sub, valid, 3, 1.0), select_blocks(scores[:, :, rows], valid, 3, 1.0))


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_every_block_selected_stays_exact_with_a_sample(arch):
    model = MODELS[arch]()
    ids = torch.randint(0, 128, (1, 200))
    ref = reference(model, ids, 8)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**ALL_EXACT, lsa_prefill_queries=2))
    out = run(model, cache, ids, 8)
    assert (out - ref).abs().max() <= 1e-4


def test_rest_entry_keeps_every_query():
    """The rest entry's logit is per query: with it, the option must not cut the scores."""
    model = tiny_llama()
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    ids = torch.randint(0, 128, (1, 120))
    seen = _selections(
        model, ids, prefill_split_tail=False, lsa_prefill_queries=4, use_summaries=False, rest_entry=True
    )
    assert 37 * group in {r for r, _ in seen}


def test_long_prefill_chunks_are_reranked_with_their_sample(monkeypatch):
    """Re-ranking needs at most RERANK_MAX_QUERIES scoring queries: a 100-query chunk is
    re-ranked when 8 of its queries score it, and not when all 100 do."""
    import flashmem.cache.ranking as fl  # where the re-rank calls them

    model = tiny_llama()
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    seen: list[int] = []

    def spying(real):  # the candidates' keys copied out, or scored where the store holds them
        def spy(qg, *a, **kw):
            seen.append(qg.shape[2] // group)
            return real(qg, *a, **kw)

        return spy

    monkeypatch.setattr(fl, "exact_page_mass", spying(fl.exact_page_mass))
    monkeypatch.setattr(fl, "exact_block_mass", spying(fl.exact_block_mass))
    for n, expect in ((8, {8}), (0, set())):
        seen.clear()
        cfg = flashmem.FlashMemoryConfig(
            **{**SMALL, "prefill_chunk": 100, "prefill_split_tail": False, "lsa_top_k": 2, "lsa_rerank": 2},
            lsa_prefill_queries=n,
        )
        with flashmem.attach(model, cfg) as cache, torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        assert set(seen) == expect
