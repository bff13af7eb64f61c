"""Block scorers and top-k selection find the block a query points at."""

from __future__ import annotations

import pytest
import torch

from flashmem import policies
from flashmem.compress.chunk_fusion import fuse_chunks
from flashmem.index import SCORERS
from flashmem.index.selection import select_blocks


def _blocks_with_needle(n=12, B=32, d=16, needle_block=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, n * B, d, generator=g)
    query = torch.randn(1, 1, 1, d, generator=g)
    keys[0, 0, needle_block * B + 7] = 40 * query[0, 0, 0] / query.norm()  # one token the query wants
    return keys, query


@pytest.mark.parametrize("name", sorted(n for n in SCORERS if not policies.SCORERS[n].needs_calibration))
def test_scorer_selects_the_block_holding_the_needle(name):
    B, n = 32, 12
    keys, query = _blocks_with_needle(n, B)
    valid = torch.ones(1, n * B, dtype=torch.bool)
    scorer = SCORERS[name]()
    if scorer.vectors:
        summaries = torch.stack(
            [scorer.summarize(keys[:, :, j * B : (j + 1) * B], valid[:, :B]) for j in range(n)], dim=2
        )
    else:  # reads the HCA entries
        logimp = torch.zeros(1, 1, n * B)
        hca = fuse_chunks(keys, keys, logimp, valid, torch.arange(n * B), B, None)
        summaries = hca.keys[:, :, :, None]
    scores = scorer.score(query, summaries)
    idx = select_blocks(scores, torch.ones(1, n, dtype=torch.bool), 1, 16**-0.5)
    assert idx.tolist() == [[[5]]]


def test_selection_never_prefers_a_padding_block():
    scores = torch.tensor([[[[5.0, 1.0, 0.5]]]])
    valid = torch.tensor([[False, True, True]])
    idx = select_blocks(scores, valid, 2, 1.0)
    assert idx.tolist() == [[[1, 2]]]


def test_follow_brings_the_page_after_a_winner_within_k():
    # page 3 is the clear winner, page 7 the runner-up, page 8 invalid (padding)
    scores = torch.tensor([[[[0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 3.0, 2.0, 0.0]]]])
    valid = torch.ones(1, 10, dtype=torch.bool)
    assert select_blocks(scores, valid, 2, 1.0).tolist() == [[[3, 7]]]
    assert select_blocks(scores, valid, 2, 1.0, follow=1).tolist() == [[[3, 4]]]
    assert select_blocks(scores, valid, 4, 1.0, follow=1).tolist() == [[[3, 4, 7, 8]]]
    assert select_blocks(scores, valid, 3, 1.0, follow=2).tolist() == [[[3, 4, 5]]]
    valid[0, 8] = False  # never selected, even as a follower
    got = select_blocks(scores, valid, 4, 1.0, follow=1)[0, 0].tolist()
    assert {3, 4, 7} <= set(got) and 8 not in got
    # every winner brings its follower, ranked right behind it: with k = 4 the top two
    # pages and their followers win over the third page
    spread = torch.tensor([[[[0.0, 6.0, 0.0, 0.0, 5.5, 0.0, 0.0, 5.0, 0.0, 0.0]]]])
    ten = torch.ones(1, 10, dtype=torch.bool)
    assert select_blocks(spread, ten, 4, 1.0, follow=1).tolist() == [[[1, 2, 4, 5]]]
    # a winner on the last page has nothing after it: k is filled by the next best
    last = torch.tensor([[[[0.0, 1.0, 0.0, 9.0]]]])
    assert select_blocks(last, torch.ones(1, 4, dtype=torch.bool), 2, 1.0, follow=1).tolist() == [[[1, 3]]]


def test_max_pool_lets_one_query_head_with_a_sharp_choice_win():
    # three heads of a GQA group like page 0 mildly; one head wants page 2 sharply
    scores = torch.tensor([[[[2.0, 0.0, 0.0], [2.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 9.0]]]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert select_blocks(scores, valid, 1, 1.0).tolist() == [[[0]]]  # mean: the group's expected mass
    assert select_blocks(scores, valid, 1, 1.0, pool="max").tolist() == [[[2]]]


def test_shared_heads_select_the_pages_with_the_most_mass_summed_over_kv_heads():
    # page distributions: KV head 0 wants page 0; head 1 prefers page 1 by a little over page 2
    probs = torch.tensor([[[[0.85, 0.0, 0.15, 0.0]], [[0.15, 0.45, 0.40, 0.0]]]]) + 1e-9
    scores = probs.log()  # [b=1, h=2, nq=1, 4]
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert select_blocks(scores, valid, 2, 1.0).tolist() == [[[0, 2], [1, 2]]]
    # summed: page 0 1.0, page 2 0.55, page 1 0.45: both heads get pages 0 and 2
    assert select_blocks(scores, valid, 2, 1.0, share_heads=True).tolist() == [[[0, 2], [0, 2]]]


def test_quest_bound_is_an_upper_bound_of_every_key():
    keys, query = _blocks_with_needle(n=1, B=32, needle_block=0)
    scorer = SCORERS["quest"]()
    bound = scorer.score(query, scorer.summarize(keys, torch.ones(1, 32, dtype=torch.bool))[:, :, None])
    assert (query @ keys.transpose(-1, -2)).max() <= bound.max() + 1e-5


def test_gaussian_score_is_the_log_mass_of_gaussian_keys():
    g = torch.Generator().manual_seed(1)
    d, n = 8, 200_000
    mu, sigma = torch.randn(d, generator=g) * 0.3, torch.rand(d, generator=g) + 0.2
    keys = (mu + sigma * torch.randn(n, d, generator=g))[None, None]
    q = torch.randn(1, 1, 1, d, generator=g)
    s = d**-0.5
    scorer = SCORERS["gaussian"]()
    summ = scorer.summarize(keys, torch.ones(1, n, dtype=torch.bool))[:, :, None]
    got = s * scorer.score(q, summ, s)
    want = torch.logsumexp(s * (q @ keys.transpose(-1, -2)), -1) - torch.log(torch.tensor(float(n)))
    assert got.item() == pytest.approx(want.item(), abs=0.02)


def test_gaussian_prefers_the_spread_a_query_points_at_when_means_tie():
    # Two blocks with the same mean key: one holds a needle token along the
    # query and its mirror image (same mean, wider along q). The mean key cannot
    # tell them apart; the variance term does.
    d, B = 16, 32
    g = torch.Generator().manual_seed(0)
    base = torch.randn(B, d, generator=g) * 0.1
    q = torch.randn(d, generator=g)
    u = q / q.norm()
    a, b = base.clone(), base.clone()
    b[3] += 4 * u
    b[9] -= 4 * u
    keys = torch.cat([a, b])[None, None]
    valid = torch.ones(1, B, dtype=torch.bool)
    means = {}
    for name in ("mean_key", "gaussian"):
        sc = SCORERS[name]()
        summ = torch.stack([sc.summarize(keys[:, :, j * B : (j + 1) * B], valid) for j in range(2)], dim=2)
        means[name] = sc.score(q[None, None, None], summ, d**-0.5)[0, 0, 0]
    assert means["mean_key"][0].item() == pytest.approx(means["mean_key"][1].item(), abs=1e-4)
    assert means["gaussian"][1] > means["gaussian"][0] + 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_mean_keys_score_without_a_decoded_copy_as_decoded_ones_do(monkeypatch, dtype):
    """IndexVectors.score: int8 mean keys are scored with their scales applied to the scores
    (MeanKeyScorer.score_coded), not to a decoded copy (`read` is not called), and give the
    scores of the decoded summaries; a scorer without score_coded is scored on `read`."""
    from flashmem.index.vectors import IndexVectors

    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 3, 40, 16
    summaries = torch.randn(b, h, n, 1, d, generator=g) * torch.linspace(0.1, 5, d)
    q = (torch.randn(b, h, 4, d, generator=g) * 2).to(dtype)
    iv = IndexVectors(b, h, 1, d, "int8", dtype, torch.device("cpu"))
    iv.extend(summaries[:, :, :25])
    iv.extend(summaries[:, :, 25:])
    mean_key = SCORERS["mean_key"]()
    want = mean_key.score(q.float(), iv.read(torch.float32))
    reads = []
    read = IndexVectors.read
    monkeypatch.setattr(IndexVectors, "read", lambda self, dt: reads.append(dt) or read(self, dt))
    got = iv.score(mean_key, q)
    assert not reads and got.dtype == dtype and got.shape == (b, h, 4, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
    # a scorer that needs the summaries decoded reads them
    quest = SCORERS["quest"]()
    iv2 = IndexVectors(b, h, 2, d, "int8", torch.float32, torch.device("cpu"))
    iv2.extend(torch.randn(b, h, n, 2, d, generator=g))
    assert quest.score_coded(q.float(), iv2.codes, iv2.scales) is None
    iv2.score(quest, q.float())
    assert reads == [torch.float32]


@pytest.mark.parametrize("pool", ["mean", "max"])
@pytest.mark.parametrize("share_heads", [False, True])
def test_blocked_index_mass_equals_the_whole_chunks(pool, share_heads):
    """A long chunk's queries scored a block at a time pool to the mass of all of them at once."""
    from flashmem.index.selection import blocked_index_mass, index_mass

    g = torch.Generator().manual_seed(3)
    b, h, nq, n, d = 2, 3, 37, 11, 8
    q = torch.randn(b, h, nq, d, generator=g)
    keys = torch.randn(b, h, n, d, generator=g)
    valid = torch.rand(b, n, generator=g) > 0.3
    calls = []

    def score(qs):
        calls.append(qs.shape[2])
        return qs @ keys.transpose(-1, -2)

    whole = index_mass(score(q), valid, 0.5, pool, share_heads)
    calls.clear()
    row_bytes = b * h * n * 4
    got = blocked_index_mass(score, q, valid, 0.5, pool, share_heads, max_bytes=5 * row_bytes)
    assert calls == [5] * 7 + [2]  # at most 5 queries' scores held at once
    assert torch.allclose(got, whole, atol=1e-6)
    assert not torch.equal(whole, index_mass(score(q[:, :, :5]), valid, 0.5, pool, share_heads))
