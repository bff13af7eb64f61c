"""`lsa_cache_pages`: the device keeps pages that left the selection, so one that comes back
is not copied over the link again (cache/working_set.py SparePages)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache.block_reads import BlockReader
from test_cache import SMALL
from tiny_models import tiny_llama

PAGED = dict(SMALL, use_summaries=False, lsa_top_k=3, lsa_page_tokens=4, prefetch_threads=0)


def _run(cache_pages: int, codec: str, hook=None, steps: int = 40, host_ranking: bool = False, monkeypatch=None):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100 + steps), generator=torch.Generator().manual_seed(2))
    if host_ranking:
        monkeypatch.setattr(BlockReader, "rank_on_host", True)
    cfg = flashmem.FlashMemoryConfig(**PAGED, working_set_codec=codec, lsa_cache_pages=cache_pages)
    cache = flashmem.attach(model, cfg)
    if hook is not None:
        cache.selection_hook = hook
    out, h2d = [], []
    with torch.no_grad():
        out.append(model(ids[:, :100], cache=cache, use_cache=True).logits[:, -1])
        for t in range(100, 100 + steps):
            before = cache.traffic_report()["totals"]["h2d_bytes"]
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
            h2d.append(cache.traffic_report()["totals"]["h2d_bytes"] - before)
    return cache, torch.cat(out), h2d


def _alternate(layer_idx: int, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Selections that take turns: pages {0, 1, 2} on even calls of a layer, {3, 4, 5} on odd."""
    n = _alternate.calls.setdefault(layer_idx, 0)  # type: ignore[attr-defined]
    _alternate.calls[layer_idx] = n + 1  # type: ignore[attr-defined]
    base = 0 if n % 2 == 0 else 3
    return (torch.arange(3) + base).expand_as(idx).contiguous()


@pytest.mark.parametrize("codec", ["model", "int8"])
def test_pages_that_come_back_are_not_copied_again_and_the_logits_do_not_change(codec):
    """Two page sets in turn: without a page cache every step copies the 3 pages it did not
    hold; with 3 spare pages per head, only the first visit of each set is copied. The pages
    attended are the same, so the logits are identical."""
    _alternate.calls = {}  # type: ignore[attr-defined]
    plain, logits0, h2d0 = _run(0, codec, _alternate)
    _alternate.calls = {}  # type: ignore[attr-defined]
    cached, logits1, h2d1 = _run(3, codec, _alternate)
    assert torch.equal(logits0, logits1)
    assert all(n > 0 for n in h2d0[1:])  # every step copies the set it did not hold
    assert sum(h2d1) < sum(h2d0) / 5  # with the cache: each set copied once (the prompt visits both)
    hits0, hits1 = plain.traffic_report()["page_cache"], cached.traffic_report()["page_cache"]
    assert hits1["hits"] > hits0["hits"] and hits1["misses"] < hits0["misses"]
    # the spare rows hold their pages' K/V as the working set held them (the set not selected now)
    layer = cached.flash_layers[0]
    spare = layer.working_set.spare
    assert spare is not None and spare.ids is not None
    other = set(range(6)) - set(layer.ws_idx[0, 0].tolist())
    assert set(spare.ids[0, 0].tolist()) - {-1} == other
    assert layer.working_set.nbytes() > plain.flash_layers[0].working_set.nbytes()  # counted as resident


@pytest.mark.parametrize("codec", ["model", "int8"])
def test_the_page_cache_changes_nothing_but_where_pages_come_from(codec, monkeypatch):
    """The recipe's own selections on a tiny model, ranked on the host (as on an accelerator):
    the same logits with and without spare pages, and no more bytes over the link."""
    _, l0, h0 = _run(0, codec, host_ranking=True, monkeypatch=monkeypatch)
    _, l1, h1 = _run(8, codec, host_ranking=True, monkeypatch=monkeypatch)
    # the same pages attended; they may sit in other working-set slots (a page back from the
    # spare takes a freed slot), which changes only the order attention sums them in
    torch.testing.assert_close(l0, l1, rtol=0, atol=1e-6)
    assert sum(h1) <= sum(h0)


def test_lru_keeps_the_most_recently_selected_pages():
    """A spare of 2 pages: after sets A={0,1,2}, B={3,4,5}, C={6,7,8} the spare holds two of
    B's pages (last selected), none of A's; a slot whose page is selected again is freed."""
    from flashmem.cache.working_set import SparePages

    spare = SparePages(2)
    P, d = 1, 2
    sets = [torch.tensor([[[0, 1, 2]]]), torch.tensor([[[3, 4, 5]]]), torch.tensor([[[6, 7, 8]]])]

    def rows(s: torch.Tensor) -> list[tuple[torch.Tensor, ...] | None]:
        k = s.float()[..., None].expand(1, 1, 3, d).contiguous()  # each page's row holds its id
        return [(k,), (k + 100,)]

    spare.spill(sets[0], rows(sets[0]), sets[1], P)
    spare.spill(sets[1], rows(sets[1]), sets[2], P)
    held = set(spare.ids[0, 0].tolist())
    assert held <= {3, 4, 5} and len(held) == 2
    hit, slot = spare.lookup(torch.tensor([[[3, 4, 5]]]))
    for page, h, sl in zip([3, 4, 5], hit[0, 0].tolist(), slot[0, 0].tolist()):
        assert h == (page in held)
        if h:  # the row in the slot is that page's
            assert spare.code[0][0][sl].tolist() == [float(page)] * d
            assert spare.code[1][0][sl].tolist() == [float(page) + 100] * d
    back = min(held)
    spare.spill(sets[2], rows(sets[2]), torch.tensor([[[back, 6, 7]]]), P)
    assert back not in spare.ids[0, 0].tolist()  # taken back: its slot went to a page of C
    assert 8 in spare.ids[0, 0].tolist()


def test_config_rejects_a_negative_page_cache():
    with pytest.raises(Exception, match="lsa_cache_pages"):
        flashmem.FlashMemoryConfig(lsa_cache_pages=-1)


@pytest.mark.parametrize("budget, tokens", [(1 / 8, 131072), (1 / 16, 131072), (1 / 8, 32768), (1 / 32, 2**20)])
def test_the_solver_fills_the_room_the_cap_leaves_with_cached_pages(budget, tokens):
    """An accelerator's recipe (device_codes): where the selected-token cap leaves room, the
    page cache takes what is left, within the budget: one page more would pass it, or the
    cache is at its most (PAGE_CACHE_MAX_SELECTIONS x the selection, or every other page)."""
    from flashmem.recipe import PAGE_CACHE_MAX_SELECTIONS
    from flashmem.sizing.budget import budget_config, predicted_ratio
    from flashmem.sizing.tiers import tier_counts

    geo = dict(group=4, head_dim=128, dtype_bytes=2)
    cfg = budget_config(budget, tokens, **geo)
    n = cfg.lsa_cache_pages
    assert n > 0
    assert predicted_ratio(cfg, tokens, **geo, peak=True) <= budget
    counts = tier_counts(cfg, tokens, peak=True)
    selected = counts.working_set // cfg.page_tokens
    at_most = min(PAGE_CACHE_MAX_SELECTIONS * selected, counts.sealed_blocks * cfg.pages_per_block - selected)
    more = cfg.model_copy(update={"lsa_cache_pages": n + 1})
    assert n == at_most or predicted_ratio(more, tokens, **geo, peak=True) > budget
    # the window and the selection are those of the config without it
    bare = budget_config(budget, tokens, **geo, lsa_cache_pages=0)
    assert bare.lsa_cache_pages == 0
    assert (bare.gpu_cache_limit, bare.lsa_top_k) == (cfg.gpu_cache_limit, cfg.lsa_top_k)


def test_no_page_cache_on_the_cpu_or_below_the_cap_or_when_named():
    from flashmem.sizing.budget import budget_config

    geo = dict(group=4, head_dim=128, dtype_bytes=2)
    assert budget_config(1 / 8, 131072, **geo, device_codes=False).lsa_cache_pages == 0  # a model on the CPU
    assert budget_config(1 / 16, 8192, **geo).lsa_cache_pages == 0  # the budget buys fewer pages than the cap
    assert budget_config(1 / 8, 131072, **geo, lsa_cache_pages=7).lsa_cache_pages == 7
    model = tiny_llama()
    assert flashmem.FlashMemoryConfig.for_budget(1 / 8, 131072, model).lsa_cache_pages == 0


def test_reordered_rows_take_their_cached_pages_with_them():
    """Beam search reorders rows (`reorder_cache`): each row's spare pages, their ids and K/V,
    move with it, or a row would take back another row's pages."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 130), generator=torch.Generator().manual_seed(4))
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**PAGED, lsa_cache_pages=6))
    with torch.no_grad():
        model(ids[:, :100], cache=cache, use_cache=True)
        for t in range(100, 130):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    spare = cache.flash_layers[0].working_set.spare
    assert spare is not None and spare.ids is not None and bool((spare.ids >= 0).all())
    b, h, s = spare.ids.shape
    before = spare.ids.clone(), [tuple(t.view(b, h * s, -1).clone() for t in c) for c in spare.code]
    cache.reorder_cache(torch.tensor([1, 0, 1]))
    assert torch.equal(spare.ids, before[0][[1, 0, 1]])
    for c, old in zip(spare.code, before[1], strict=True):
        for t, o in zip(c, old, strict=True):
            assert torch.equal(t.view(3, h * s, -1), o[[1, 0, 1]])


@pytest.mark.parametrize("beams", [2, 3])
def test_beam_search_moves_each_rows_cached_pages_with_it(beams):
    """Beam search reorders rows every step: a row's spare pages follow it (or a beam would take
    back another beam's K/V). The page cache changes no output."""
    torch.manual_seed(6)
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 120))
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=30, num_beams=beams, num_return_sequences=2)
    outs = []
    for pages in (0, 6):
        cfg = flashmem.FlashMemoryConfig(**PAGED, lsa_cache_pages=pages)
        cache = flashmem.attach(model, cfg)
        outs.append(model.generate(ids, cache=cache, output_scores=True, return_dict_in_generate=True, **kw))
        if pages:
            spare = cache.flash_layers[0].working_set.spare
            assert spare is not None and spare.ids is not None and bool((spare.ids >= 0).any())
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].scores, outs[1].scores, strict=True))
