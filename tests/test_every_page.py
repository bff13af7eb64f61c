"""A layer whose budget covers every sealed page attends them all without ranking them
(`tiered_attention.selects_every_page`): the same logits as ranking them, nothing ranked."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache import tiered_attention
from flashmem.cache.ranking import CandidateRanker
from test_cache import run
from tiny_models import MODELS

# The recipe's shape, shrunk: 4-token pages in 16-token blocks, an int8 index, a re-rank on an
# int8 key copy, an int8 working set, the open block's room buying pages, and the rest entry.
RECIPE_LIKE = dict(
    gpu_cache_limit=4,
    sink_tokens=2,
    hca_chunk_size=16,
    csa_band_tokens=0,
    use_summaries=False,
    lsa_page_tokens=4,
    lsa_scorer="mean_key",
    lsa_index_dtype="int8",
    lsa_rerank=4,
    lsa_rerank_min_pages=8,
    lsa_rerank_mirror="int8",
    working_set_codec="int8",
    lsa_open_room=True,
    rest_entry=True,
    prefill_chunk=37,
)


def _counting_rank(monkeypatch) -> list[int]:
    """Count CandidateRanker.rank calls (a ranked selection) -> the list calls append to."""
    calls: list[int] = []
    orig = CandidateRanker.rank

    def rank(self, *a, **k):
        calls.append(self.layer_idx)
        return orig(self, *a, **k)

    monkeypatch.setattr(CandidateRanker, "rank", rank)
    return calls


def _run(model, cfg, ids, steps, mask=None, ranked=False, monkeypatch=None):
    if ranked:
        monkeypatch.setattr(tiered_attention, "selects_every_page", lambda *a: False)
    try:
        return run(model, flashmem.attach(model, cfg), ids, steps, mask)
    finally:
        if ranked:
            monkeypatch.undo()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_every_page_unranked_equals_every_page_ranked(arch, monkeypatch):
    """fp64, so the one thing that could differ is what is attended: prefill, then decode
    steps across several seals, every layer's budget above its pages throughout."""
    model = MODELS[arch]().double()
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    cfg = flashmem.FlashMemoryConfig(**RECIPE_LIKE, lsa_top_k=64)
    calls = _counting_rank(monkeypatch)
    fast = _run(model, cfg, ids, 40)
    assert calls == []  # nothing ranked: the budget covers every page
    calls = _counting_rank(monkeypatch)
    slow = _run(model, cfg, ids, 40, ranked=True, monkeypatch=monkeypatch)
    assert (fast - slow).abs().max() <= 1e-10


def test_every_page_with_padded_rows(monkeypatch):
    """Two rows, the first left-padded: padding pages are in the working set, hidden."""
    model = MODELS["llama"]().double()
    ids = torch.randint(0, 128, (2, 100), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[0, :23] = 0
    cfg = flashmem.FlashMemoryConfig(**RECIPE_LIKE, lsa_top_k=64)
    fast = _run(model, cfg, ids, 30, mask)
    slow = _run(model, cfg, ids, 30, mask, ranked=True, monkeypatch=monkeypatch)
    assert (fast - slow).abs().max() <= 1e-10


def test_ranking_starts_when_the_pages_outgrow_the_budget(monkeypatch):
    """lsa_top_k 12 (no open room): a decode step ranks exactly when its layer holds more
    than 12 sealed pages, and not before."""
    model = MODELS["llama"]().double()
    cfg = flashmem.FlashMemoryConfig(**{**RECIPE_LIKE, "lsa_open_room": False}, lsa_top_k=12)
    cache = flashmem.attach(model, cfg)
    calls = _counting_rank(monkeypatch)
    ranked_at: list[tuple[int, int]] = []  # (sealed pages at the step, rank calls it made)
    with torch.no_grad():
        out = model(torch.randint(0, 128, (1, 30)), cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(60):
            pages = cache.flash_layers[0].num_sealed * cfg.pages_per_block
            before = len(calls)
            out = model(tok, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            ranked_at.append((pages, len(calls) - before))
    layers = len(cache.flash_layers)
    assert {n for p, n in ranked_at if 0 < p <= 12} == {0}
    assert {n for p, n in ranked_at if p > 12} == {layers}
    assert any(0 < p <= 12 for p, _ in ranked_at) and any(p > 12 for p, _ in ranked_at)
