"""The second hop (`lsa_feedback_share`): a share of the selected pages goes to pages that look
like the best selected ones (index/selection.py `feedback_pages`, cache/ranking.py)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.errors import FlashMemError
from flashmem.index.selection import feedback_pages, pool_mass
from test_cache import SMALL
from tiny_models import tiny_llama

torch.set_num_threads(1)


def _pages() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """10 pages of 8-dim summaries: 0, 4, 7 and 9 one pattern (a note), the rest noise; the
    query found page 9 (most mass) and pages 1 and 2."""
    g = torch.Generator().manual_seed(0)
    vecs = torch.randn(1, 1, 10, 8, generator=g)
    note = 3 * torch.randn(8, generator=g)
    for j in (0, 4, 7, 9):
        vecs[0, 0, j] = note + 0.3 * torch.randn(8, generator=g)
    mass = torch.full((1, 1, 10), 0.01)
    mass[0, 0, 9], mass[0, 0, 1], mass[0, 0, 2] = 0.5, 0.3, 0.2
    idx = torch.tensor([[[1, 2, 9]]])
    return idx, mass, vecs


def test_the_share_goes_to_the_pages_most_like_the_best_pick():
    idx, mass, vecs = _pages()
    allowed = torch.ones(1, 1, 10, dtype=torch.bool)
    # one seed (page 9), two pages of the share: the two best picks stay, the lowest (2) makes room
    out = feedback_pages(torch.tensor([[[1, 2, 5, 9]]]), mass, vecs, allowed, share=2, seeds=1)
    assert out.shape == (1, 1, 4)
    kept = {1, 9}
    new = set(out[0, 0].tolist()) - kept
    assert kept <= set(out[0, 0].tolist()) and new <= {0, 4, 7} and len(new) == 2
    assert out[0, 0].tolist() == sorted(out[0, 0].tolist())
    # three of the share: every other note, in place of pages 1 and 2
    assert feedback_pages(idx, mass, vecs, allowed, share=2, seeds=1)[0, 0].tolist() in (
        [0, 4, 9],
        [4, 7, 9],
        [0, 7, 9],
    )
    # a page not allowed is never brought in
    allowed[0, 0, 4] = False
    out = feedback_pages(idx, mass, vecs, allowed, share=2, seeds=1)[0, 0].tolist()
    assert 4 not in out and out == [0, 7, 9]
    # no share (or every page selected): the selection as it was
    assert torch.equal(feedback_pages(idx, mass, vecs, allowed, share=0), idx)
    every = torch.arange(10).view(1, 1, 10)
    assert torch.equal(feedback_pages(every, mass, vecs, allowed, share=3), every)


def _run(model, ids, steps, **kw):
    """Prefill + greedy decode; per selecting call: (layer, page ids, index scores)."""
    seen = []
    cfg = flashmem.FlashMemoryConfig(**{**SMALL, **kw})
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        cache.selection_hook = lambda layer, idx, scores: seen.append((layer, idx.clone(), scores.clone())) or idx
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        for _ in range(steps):
            out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        layers = [layer for layer in cache.layers if hasattr(layer, "ranker")]
        means = [layer.ranker.page_values for layer in layers]
        blocks = [[layer.fetch_block(j)[1] for j in range(layer.num_sealed)] for layer in layers]
    return seen, means, blocks


def test_the_cache_takes_the_share_from_the_pages_mean_values():
    """On a tiny model, a step's feedback selection is `feedback_pages` of the plain selection,
    with the index's mass and each page's mean value as the stored blocks give it."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=8)
    plain, none, _ = _run(model, ids, 3, **kw)
    fed, means, blocks = _run(model, ids, 3, **kw, lsa_feedback_share=0.25, lsa_feedback_seeds=1)
    assert none == [None] * len(none) and all(m is not None for m in means)
    # the mean values are the stored blocks' values averaged over each page's 4 tokens
    for pv, bl in zip(means, blocks):
        ref = torch.cat([v.float().view(*v.shape[:2], -1, 4, v.shape[-1]).mean(-2) for v in bl], dim=2)
        assert torch.allclose(pv.means[:, :, : ref.shape[2]], ref, atol=1e-5)
    # layer 0's keys and values come from the embeddings alone: its calls score the same in both runs
    pv = means[0]
    pairs = [(a, b) for a, b in zip(plain, fed) if a[0] == 0 and torch.equal(a[2], b[2])]
    changed, checked = 0, 0
    for (_, idx0, scores), (_, idx1, _) in pairs:
        n = scores.shape[-1]
        mass = pool_mass(torch.softmax(scores.float() * model.config.head_dim**-0.5, -1))
        allowed = torch.ones(1, 1, n, dtype=torch.bool)
        want = feedback_pages(idx0, mass, pv.means[:, :, :n], allowed, share=2, seeds=1)
        assert torch.equal(idx1, want)
        checked += idx0.shape[-1] < n
        changed += not torch.equal(idx0, idx1)
    assert checked >= 3
    assert changed > 0  # the second hop chose other pages somewhere


def test_a_share_out_of_range_is_refused():
    with pytest.raises((FlashMemError, ValueError)):
        flashmem.FlashMemoryConfig(**SMALL, lsa_feedback_share=0.9)


def test_the_pages_mean_values_follow_their_rows():
    """Rows reordered (beam search) or selected (batch selection): each row keeps its own pages'
    mean values, as its stored blocks give them, and the next steps run on the new rows."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(5))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=8)
    cfg = flashmem.FlashMemoryConfig(**{**SMALL, **kw, "lsa_feedback_share": 0.25, "lsa_feedback_seeds": 1})
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        layers = [layer for layer in cache.layers if hasattr(layer, "ranker")]
        before = [layer.ranker.page_values.means.clone() for layer in layers]
        cache.reorder_cache(torch.tensor([1, 0]))
        for layer, old in zip(layers, before):
            assert torch.equal(layer.ranker.page_values.means, old[[1, 0]])
        cache.batch_select_indices(torch.tensor([1]))
        out = model(out.argmax(-1)[[0, 1]][[1]], cache=cache, use_cache=True).logits[:, -1:]
        for layer in layers:
            pv = layer.ranker.page_values
            assert pv.means.shape[0] == 1
            ref = torch.cat(
                [v.float().view(*v.shape[:2], -1, 4, v.shape[-1]).mean(-2) for v in
                 (layer.fetch_block(j)[1] for j in range(pv.blocks))], dim=2,
            )  # fmt: skip
            assert torch.allclose(pv.means[:, :, : ref.shape[2]], ref, atol=1e-5)
