"""Block scorers and top-k selection find the block a query points at."""

from __future__ import annotations

import pytest
import torch

from flashmem.compress.chunk_fusion import fuse_chunks
from flashmem.index import SCORERS
from flashmem.index.selection import select_blocks


def _blocks_with_needle(n=12, B=32, d=16, needle_block=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, n * B, d, generator=g)
    query = torch.randn(1, 1, 1, d, generator=g)
    keys[0, 0, needle_block * B + 7] = 40 * query[0, 0, 0] / query.norm()  # one token the query wants
    return keys, query


@pytest.mark.parametrize("name", sorted(SCORERS))
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


def test_quest_bound_is_an_upper_bound_of_every_key():
    keys, query = _blocks_with_needle(n=1, B=32, needle_block=0)
    scorer = SCORERS["quest"]()
    bound = scorer.score(query, scorer.summarize(keys, torch.ones(1, 32, dtype=torch.bool))[:, :, None])
    assert (query @ keys.transpose(-1, -2)).max() <= bound.max() + 1e-5
