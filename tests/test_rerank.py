"""Re-ranking candidate pages by their exact keys (`lsa_rerank`)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.index import SCORERS
from flashmem.index.rerank import exact_page_mass, streamed_page_mass
from flashmem.index.selection import select_blocks
from test_cache import SMALL
from tiny_models import tiny_llama

torch.set_num_threads(1)


@pytest.mark.parametrize("step", [1, 3, 7, 40])
def test_streamed_mass_is_one_softmax_over_every_candidate(step):
    """Candidates' keys taken a chunk of `step` at a time (a disk tier's re-rank reads them so):
    the mass of one softmax over every candidate's tokens, padding masked, each chunk asked once
    in order; a chunk that cannot be had gives None (the caller reads them whole)."""
    g = torch.Generator().manual_seed(1)
    b, h, c, P, d, nq = 2, 3, 11, 4, 8, 5
    keys = torch.randn(b, h, c, P, d, generator=g)
    qg = torch.randn(b, h, nq, d, generator=g)
    valid = torch.rand(b, h, c, P, generator=g) > 0.2
    asked: list[tuple[int, int]] = []

    def keys_of(s: int, e: int) -> torch.Tensor:
        asked.append((s, e))
        return keys[:, :, s:e].clone()

    got = streamed_page_mass(qg, keys_of, valid, 0.3, "max", False, step)
    assert got is not None
    assert torch.allclose(got, exact_page_mass(qg, keys, valid, 0.3, "max"), atol=1e-6)
    assert asked == [(s, min(c, s + step)) for s in range(0, c, step)]
    declined = streamed_page_mass(qg, lambda s, e: None if s else keys[:, :, s:e], valid, 0.3, "max", False, 3)
    assert declined is None


def test_exact_mass_finds_the_page_a_mean_key_blurs():
    # page 0: one token the query wants among 15 that point away (its mean key is weak);
    # page 1: 16 tokens mildly aligned (a stronger mean key, less mass in total)
    g = torch.Generator().manual_seed(0)
    d, P = 16, 16
    q = torch.randn(d, generator=g)
    u = q / q.norm()
    page0 = -0.5 * u.repeat(P, 1)
    page0[7] = 12 * u
    page1 = 1.0 * u.repeat(P, 1) + 0.1 * torch.randn(P, d, generator=g)
    keys = torch.stack([page0, page1])[None, None]  # [b=1, h=1, pages=2, P, d]
    qg = q[None, None, None]  # [1, 1, nq=1, d]
    valid = torch.ones(1, 1, 2, P, dtype=torch.bool)
    scorer = SCORERS["mean_key"]()
    summaries = torch.stack([scorer.summarize(keys[:, :, j], valid[:, 0, j]) for j in range(2)], dim=2)
    by_index = select_blocks(scorer.score(qg, summaries, 1.0), torch.ones(1, 2, dtype=torch.bool), 1, 1.0)
    assert by_index.tolist() == [[[1]]]
    mass = exact_page_mass(qg, keys, valid, 1.0)
    assert mass.argmax(-1).tolist() == [[0]]
    # the mass is each page's share of one softmax over all candidate tokens
    logits = (keys.reshape(-1, d) @ q).float()
    ref = torch.softmax(logits, 0).view(2, P).sum(-1)
    assert torch.allclose(mass[0, 0], ref, atol=1e-6)
    # padding tokens carry no mass
    valid[..., 7] = False
    assert exact_page_mass(qg, keys, valid, 1.0)[0, 0, 0] < 0.01


def _run(model, ids, steps, **kw):
    """Prefill + greedy decode; the pages each layer selected at every step."""
    seen = []
    cfg = flashmem.FlashMemoryConfig(**{**SMALL, **kw})
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        cache.selection_hook = lambda layer, idx, scores: seen.append((layer, idx.clone())) or idx
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        logits = [out]
        for _ in range(steps):
            out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
            logits.append(out)
    return torch.cat(logits, 1), seen


def test_with_one_token_pages_and_every_candidate_rerank_keeps_the_exact_ranking():
    """Pages of 1 token, scored by their own (model-dtype) key, rank as dense attention
    does; re-ranking every page by its exact key must then choose the same pages."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=1, lsa_index_dtype="model", lsa_top_k=12, csa_chunk_size=1)
    plain, sel_plain = _run(model, ids, 4, **kw)
    reranked, sel_rerank = _run(model, ids, 4, **kw, lsa_rerank=16)  # 12 * 16 candidates >= every page
    assert len(sel_plain) == len(sel_rerank) > 0
    assert all(torch.equal(a[1], b[1]) for a, b in zip(sel_plain, sel_rerank))
    assert torch.allclose(plain, reranked, atol=1e-5)


def test_rerank_changes_the_choice_of_a_blurred_index_and_reads_the_same_both_ways():
    """Pages scored by an int8 mean key: the exact keys of 4x the candidates pick
    differently on some steps, and the same whether the candidates come from the
    memory store's arena or as whole blocks through the prefetcher."""
    from flashmem.cache.flash_layer import FlashLayer

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=3)
    _, sel_plain = _run(model, ids, 6, **kw)
    direct, sel_rerank = _run(model, ids, 6, **kw, lsa_rerank=4)
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(sel_plain, sel_rerank))
    FlashLayer.read_memory_directly = False
    try:
        through, sel_through = _run(model, ids, 6, **kw, lsa_rerank=4)
    finally:
        FlashLayer.read_memory_directly = True
    assert all(torch.equal(a[1], b[1]) for a, b in zip(sel_rerank, sel_through))
    assert torch.equal(direct, through)


def test_chunks_longer_than_the_limit_keep_the_index_choice(monkeypatch):
    from flashmem.cache import ranking

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=3)
    plain_out, plain = _run(model, ids, 6, **kw)
    monkeypatch.setattr(ranking, "RERANK_MAX_QUERIES", 0)  # every chunk (and step) is longer
    out, sel = _run(model, ids, 6, **kw, lsa_rerank=4)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(plain, sel))
    assert torch.equal(out, plain_out)


def test_a_candidate_floor_over_every_page_makes_the_index_order_irrelevant(monkeypatch):
    """lsa_rerank_min_pages: with at least as many candidates as pages, the exact keys
    alone choose, so an index scoring at random selects what the real one does; with
    r * k candidates only, it does not."""
    from flashmem.cache.ranking import CandidateRanker

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=3, lsa_rerank=2)
    floor = dict(kw, lsa_rerank_min_pages=10_000)
    real_out, real = _run(model, ids, 6, **floor)
    real_r2_out, _ = _run(model, ids, 6, **kw)
    scores = CandidateRanker.scores
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        CandidateRanker, "scores", lambda self, qg, s, h: torch.rand(scores(self, qg, s, h).shape, generator=gen)
    )
    rand_out, rand = _run(model, ids, 6, **floor)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(real, rand))
    assert torch.equal(real_out, rand_out)
    rand_r2_out, _ = _run(model, ids, 6, **kw)
    assert not torch.equal(real_r2_out, rand_r2_out)


def test_the_candidate_floor_bounds_the_reads_per_step(monkeypatch):
    """Candidates per step: max(r * k, lsa_rerank_min_pages), never more than the pages."""
    from flashmem.cache.ranking import CandidateRanker

    seen = []
    rerank, in_place = CandidateRanker.rerank, CandidateRanker.rerank_in_place

    def counting(self, cand, qg, ptv, k_sel, scaling):
        seen.append((cand.shape[-1], ptv.shape[1]))
        return rerank(self, cand, qg, ptv, k_sel, scaling)

    def counting_in_place(self, qg, ptv, k_sel, scaling, num_sealed, cand=None):
        seen.append((ptv.shape[1] if cand is None else cand.shape[-1], ptv.shape[1]))
        return in_place(self, qg, ptv, k_sel, scaling, num_sealed, cand)

    monkeypatch.setattr(CandidateRanker, "rerank", counting)
    monkeypatch.setattr(CandidateRanker, "rerank_in_place", counting_in_place)
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=3, lsa_rerank=2)
    _run(model, ids, 4, **kw, lsa_rerank_min_pages=20)
    assert seen and all(c == min(20, n) for c, n in seen)
    assert any(n > 20 for _, n in seen)  # the floor, not every page, on the long steps
    seen.clear()
    _run(model, ids, 4, **kw)
    assert seen and all(c == min(6, n) for c, n in seen)


@pytest.mark.parametrize("floor", [10_000, 0])
def test_candidates_scored_in_place_choose_as_their_copied_keys_do(monkeypatch, floor):
    """Candidates that are every page (floor) or at least a third of them (4 x 6 of up to
    ~70 pages) are scored where the memory store holds them (`block_keys`, no copy into page
    order; every page: no index stage); the choice and the logits are those of the
    candidates' keys copied out page by page."""
    from flashmem.cache.ranking import CandidateRanker
    from flashmem.store.memory import MemoryStore

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(6))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=6, lsa_rerank=4)
    kw["lsa_rerank_min_pages"] = floor
    in_place, used = CandidateRanker.rerank_in_place, []

    def counting(self, qg, ptv, k_sel, scaling, num_sealed, cand=None):
        out = in_place(self, qg, ptv, k_sel, scaling, num_sealed, cand)
        used.append((cand is None, out is not None))
        return out

    monkeypatch.setattr(CandidateRanker, "rerank_in_place", counting)
    in_place_out, chosen = _run(model, ids, 6, **kw)
    assert used and all(ok for _, ok in used)
    # the floor: every page on every step; without it, candidates a part of the pages on long steps
    assert all(every for every, _ in used) if floor else any(not every for every, _ in used)
    monkeypatch.setattr(MemoryStore, "block_keys", lambda self, *a: None)  # the copying path
    copied_out, copied = _run(model, ids, 6, **kw)
    assert len(chosen) == len(copied) > 0
    assert all(torch.equal(a[1], b[1]) for a, b in zip(chosen, copied))
    assert torch.allclose(in_place_out, copied_out, atol=1e-5)


def test_every_page_a_candidate_counts_the_pages_the_last_step_had_as_hits():
    """When the re-rank's candidates are every sealed page, a step's candidate hits are the
    pages the last step had (counted without a search) and its misses the pages sealed since:
    per step hits + misses = b * h * pages, and the hits follow the page count of the step before."""
    model = tiny_llama()
    kw = dict(
        SMALL,
        lsa_page_tokens=4,
        lsa_top_k=2,
        lsa_rerank=4,
        lsa_rerank_min_pages=256,
        use_summaries=False,
        prefill_chunk=4096,
    )
    ids = torch.randint(0, 128, (1, 90))
    pages: list[int] = []
    with flashmem.attach(model, flashmem.FlashMemoryConfig(**kw)) as cache, torch.no_grad():
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        for _ in range(40):  # 40 tokens: the 16-token blocks seal twice more
            layer = cache.flash_layers[0]
            pages.append(layer.num_sealed * layer.cfg.pages_per_block)  # what this step ranks
            out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        traffic = layer.reader.traffic
        traffic.begin_step(1, 0, 0)  # closes the last decode step (and opens one, left out below)
        b, h, layers = 1, layer.sink_k.shape[1], len(cache.flash_layers)
    steps = traffic.steps[-len(pages) - 1 : -1]
    assert len(steps) == len(pages) and len(set(pages)) > 1  # pages were sealed while decoding
    for i, (s, n) in enumerate(zip(steps, pages)):
        assert s.candidate_hits + s.candidate_misses == layers * b * h * n
        if i:
            assert s.candidate_hits == layers * b * h * pages[i - 1]
