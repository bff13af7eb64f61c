"""The in-place re-rank scored by a host copy of the sealed keys (`lsa_rerank_mirror`)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache import rerank_codes
from flashmem.cache.rerank_codes import KeyMirror
from test_cache import SMALL
from test_rerank import _run
from tiny_models import tiny_llama

torch.set_num_threads(1)
# every sealed page a candidate (the `every` path) or 48 of about 120 (candidates masked in place)
EVERY = dict(lsa_top_k=3, lsa_rerank=4, lsa_rerank_min_pages=100_000)
MASKED = dict(lsa_top_k=3, lsa_rerank=16, lsa_rerank_min_pages=0)
KW = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_layer_shares=None)


def _arena_keys(cache, layer: int = 0) -> torch.Tensor:
    """The cold tier's keys of every sealed block of a layer, in token order [b, h, T, d]."""
    lay = cache.layers[layer]
    blocks = [lay.reader.fetch_block(j, on_host=True)[0] for j in range(lay.num_sealed)]
    return torch.cat(blocks, dim=2)


@pytest.mark.parametrize("cands", [EVERY, MASKED], ids=["every", "masked"])
def test_a_bf16_mirror_selects_the_pages_exact_keys_select(monkeypatch, cands):
    """Tiny model, 500 tokens, 8 decode steps: every selection is re-ranked from the mirror,
    and the bf16 mirror picks the same pages as the exact keys on every one of them (44 of 44
    on each of seeds 0-2, both paths; int8 per token: 34-43 of 44, not asserted here)."""
    calls = []
    logits = KeyMirror.logits
    monkeypatch.setattr(KeyMirror, "logits", lambda self, q, *a: calls.append(1) or logits(self, q, *a))
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(0))
    exact, sel_exact = _run(model, ids, 8, **KW, **cands)
    assert not calls
    got, sel = _run(model, ids, 8, **KW, **cands, lsa_rerank_mirror="bf16")
    assert len(calls) == len(sel) == len(sel_exact) > 0  # every selection scored the mirror
    assert all(torch.equal(a[1], b[1]) for a, b in zip(sel_exact, sel))
    assert torch.allclose(exact, got, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_the_mirror_holds_the_cold_tiers_keys_through_row_changes_and_a_restore(dtype):
    """After prefill the mirror is the cold tier's keys (rounded); rows reordered (beam search)
    reorder it; a cache whose blocks reached its cold tier without a seal (a restored
    server state) reads them back on first use."""
    from flashmem.serve import state

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(7))
    cfg = flashmem.FlashMemoryConfig(**{**SMALL, **KW, **EVERY, "lsa_rerank_mirror": dtype})
    tol = 1e-2 if dtype == "bf16" else 2e-2  # relative to each token's largest channel

    def check(cache):
        m = cache.layers[0].ranker.codes
        assert isinstance(m, KeyMirror) and m.n == cache.layers[0].num_sealed > 0
        want = _arena_keys(cache)
        assert m.k is not None and m.k.shape[2] >= m.tokens == want.shape[2]
        held = m.k[:, :, : m.tokens].float()
        if dtype == "int8":
            assert m.scale is not None
            held = held * m.scale[:, :, : m.tokens, None]
        err = (held - want.float()).abs().amax(-1) / want.float().abs().amax(-1).clamp_min(1e-6)
        assert float(err.max()) < tol

    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        check(cache)
        m = cache.layers[0].ranker.codes
        before = m.k[:, :, : m.tokens].clone()
        cache.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(cache.layers[0].ranker.codes.k[:, :, : m.tokens], before.flip(0))
        check(cache)  # the cold tier's reads follow the row map too
        model(ids[:, -1:], cache=cache, use_cache=True)  # decoding after the reorder
        check(cache)
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        mark = state.mark(cache)
        first = model(ids[:1], cache=cache, use_cache=True).logits[:, -1:]
        rec = state.export_delta(cache, mark)
        want = model(first.argmax(-1), cache=cache, use_cache=True).logits
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        state.import_records(cache, [rec])
        assert cache.layers[0].ranker.codes.n == 0  # nothing sealed through this cache yet
        got = model(first.argmax(-1), cache=cache, use_cache=True).logits
        check(cache)
    assert torch.allclose(got, want, atol=1e-5)


def test_a_stale_mirror_changes_the_choice():
    """The choice comes from the mirror: its rows swapped behind the cache's back, the two
    rows of a batch select differently than with the mirror kept right."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 500), generator=torch.Generator().manual_seed(4))
    cfg = flashmem.FlashMemoryConfig(**{**SMALL, **KW, **EVERY, "lsa_rerank_mirror": "bf16"})

    def decode(corrupt: bool):
        seen = []
        with flashmem.attach(model, cfg) as cache, torch.no_grad():
            out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
            if corrupt:
                for lay in cache.layers:
                    m = lay.ranker.codes
                    if isinstance(m, KeyMirror) and m.k is not None:
                        m.k = m.k.flip(0).contiguous()
            cache.selection_hook = lambda layer, idx, scores: seen.append(idx.clone()) or idx
            for _ in range(4):
                out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        return seen

    right, stale = decode(False), decode(True)
    assert len(right) == len(stale) > 0
    assert any(not torch.equal(a, b) for a, b in zip(right, stale))


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_mirror_logits_follow_the_exact_logits(dtype):
    """Keys with channels of different ranges (RoPE's): the mirror's logits within a small
    fraction of the largest exact logit; blocks appended in pieces land in token order."""
    g = torch.Generator().manual_seed(0)
    b, h, d, B = 2, 3, 64, 16
    k = torch.randn(b, h, 10 * B, d, generator=g) * torch.linspace(0.2, 6, d)
    q = torch.randn(b, h, 3, d, generator=g)
    m = KeyMirror(dtype, B)
    m.extend(k[:, :, : 3 * B])
    m.extend(k[:, :, 3 * B : 9 * B + 5])  # a partial block is not held
    assert m.n == 9
    m.fill(10, lambda j: k[:, :, j * B : (j + 1) * B])
    assert m.n == 10 and m.nbytes() == b * h * 10 * B * (2 * d if dtype == "bf16" else d + 4)
    want = q @ k.transpose(-1, -2)
    got = m.logits(q)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert got.is_contiguous() or dtype == "bf16"  # int8: query-major, as token_page_mass reads it
    err = float((got - want).abs().max() / want.abs().max())
    assert err < (0.01 if dtype == "bf16" else 0.03), err
    m.fill(4, lambda j: k[:, :, j * B : (j + 1) * B])  # fewer sealed: the blocks past them go
    assert m.tokens == 4 * B and m.logits(q).shape[-1] == 4 * B
    m.select_rows(torch.tensor([1, 1]))
    assert torch.allclose(m.logits(q[[1, 1]])[0], m.logits(q[[1, 1]])[1])


def test_a_mirror_with_a_code_is_refused():
    with pytest.raises(Exception, match="lsa_rerank_mirror.*allowed"):
        flashmem.FlashMemoryConfig(lsa_rerank_mirror="bf16", lsa_rerank_codec="int4")
    with pytest.raises(ValueError, match="allowed: bf16 or int8"):
        rerank_codes.KeyMirror("fp8", 16)


@pytest.mark.parametrize("mirror, per_element", [("int8", 1), ("bf16", 2)])
def test_memory_report_counts_the_key_copy_as_host_bytes(mirror, per_element):
    """`memory_report()["rerank_host_bytes"]` is the copy's bytes: every sealed token's key per
    layer and KV head (int8: d codes and an fp32 scale; bf16: 2 bytes an element), 0 without it."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    reports = {}
    for name in ("none", mirror):
        cfg = flashmem.FlashMemoryConfig(**{**SMALL, **KW, **EVERY, "lsa_rerank_mirror": name})
        with flashmem.attach(model, cfg) as cache, torch.no_grad():
            out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
            model(out.argmax(-1), cache=cache, use_cache=True)
            reports[name] = cache.memory_report()
            lay = cache.layers[0]
            b, h, _, d = lay.sink_k.shape
            tokens = lay.num_sealed * cfg.hca_chunk_size
            layers = len(cache.flash_layers)
    assert reports["none"]["rerank_host_bytes"] == 0
    scale = 4 if mirror == "int8" else 0
    assert reports[mirror]["rerank_host_bytes"] == layers * b * h * tokens * (d * per_element + scale) > 0
    # host memory: not in the device's resident bytes
    assert reports[mirror]["managed_resident_bytes"] == reports["none"]["managed_resident_bytes"]


@pytest.mark.parametrize("layout", ["query-major", "token-major"])
@pytest.mark.parametrize("pool, masked", [("mean", False), ("mean", True), ("max", True)])
def test_page_mass_in_place_equals_the_generic_one(pool, masked, layout):
    """token_page_mass works on fp32 logits in place in either contiguous layout (the int8
    mirror's query-major, the bf16 mirror's token-major), the softmax along the tokens; it
    gives what the generic path (a scaled copy) gives, masked tokens (a row with none valid
    included) and pooling alike, and scores in place."""
    from flashmem.index.rerank import _page_mass, token_page_mass

    g = torch.Generator().manual_seed(3)
    b, h, nq, pages, P = 2, 3, 4, 6, 4
    by_token = torch.randn(b, h, pages * P, nq, generator=g) * 3
    valid = torch.ones(b, 1, pages * P, dtype=torch.bool)
    if masked:
        valid[0, 0, 5:13] = False
        valid[1] = False  # nothing valid in row 1: zero mass, not NaN
    want = _page_mass(by_token.transpose(-1, -2), valid[:, :, None, :], P, 0.5, pool, False)
    logits = by_token.clone().transpose(-1, -2)  # token-major
    if layout == "query-major":
        logits = logits.contiguous()
    before = logits.clone()
    got = token_page_mass(logits, valid, P, 0.5, pool)
    assert got.shape == (b, h, pages) and not torch.isnan(got).any()
    torch.testing.assert_close(got, want)
    assert not torch.equal(logits, before)  # the caller's logits were scaled in place, not copied
    if masked:
        assert torch.equal(got[1], torch.zeros(h, pages))
        assert float(got[0, :, 2].abs().max()) == 0.0 < float(got[0, :, 1].min())  # page 2: every token masked


@pytest.mark.parametrize("cands", [EVERY, MASKED], ids=["every", "masked"])
def test_new_pages_keys_cut_from_the_int8_copy_are_what_the_working_set_codes(monkeypatch, cands):
    """An int8 working set takes its new pages' key codes from the int8 key copy (the same code
    of the same keys) instead of reading the cold tier's keys and coding them again: two rows,
    every step's held codes and scales and the logits equal those of a run that does not use
    the copy, and the copy's path was taken in the first run only."""
    from flashmem.cache.ranking import CandidateRanker

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(3))
    cfg = flashmem.FlashMemoryConfig(
        **{**SMALL, **KW, **cands, "lsa_rerank_mirror": "int8", "working_set_codec": "int8"}
    )
    cut: list[int] = []
    page_codes = KeyMirror.page_codes
    monkeypatch.setattr(KeyMirror, "page_codes", lambda self, *a: cut.append(1) or page_codes(self, *a))

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits, held = [], []
        with flashmem.attach(model, cfg) as cache, torch.no_grad():
            out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
            for _ in range(6):
                logits.append(out)
                out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
                for lay in cache.layers:
                    code = lay.working_set.code[0]
                    assert code is not None and len(code) == 2  # int8: codes and scales
                    held.extend(t.clone() for t in code)
        return torch.cat(logits, 1), held

    got, held = run()
    taken = len(cut)
    assert taken > 0
    monkeypatch.setattr(CandidateRanker, "key_copy", lambda self, num_sealed: None)
    want, held_want = run()
    assert len(cut) == taken
    assert torch.equal(got, want)
    assert len(held) == len(held_want) and all(torch.equal(a, b) for a, b in zip(held, held_want))


@pytest.mark.parametrize("mirror", ["int8", "none"])
def test_the_in_place_rerank_pools_its_queries_in_blocks_with_the_same_choice(monkeypatch, mirror):
    """The in-place re-rank's logits over every sealed token (the key copy's, or the arena's
    keys) for all of a selection's queries grow with the context: past the score bound they
    are taken a block of queries at a time and pooled as they come. The same pages on every
    selection, and the same logits."""
    from flashmem.cache import ranking
    from flashmem.index import selection

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(3))
    kw = dict(**KW, **EVERY, lsa_rerank_mirror=mirror)
    whole, sel_whole = _run(model, ids, 6, **kw)
    blocks = []
    real = ranking.pooled_in_blocks
    monkeypatch.setattr(
        ranking, "pooled_in_blocks", lambda f, q, rows, *a: blocks.append(rows < q.shape[2]) or real(f, q, rows, *a)
    )
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES_CPU", 1)  # one query row at a time
    got, sel = _run(model, ids, 6, **kw)
    assert blocks and all(blocks)  # every in-place re-rank went in blocks
    assert len(sel) == len(sel_whole) > 0 and all(torch.equal(a[1], b[1]) for a, b in zip(sel_whole, sel))
    assert torch.allclose(whole, got, atol=1e-5)


def test_each_block_of_queries_counts_its_read_of_the_key_copy(monkeypatch):
    """A re-rank whose queries go in blocks reads the key copy once per block: host_read_bytes
    says so (a decode step's group of 2 queries in blocks of 1: twice the copy's bytes)."""
    from flashmem.index import selection

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(5))
    cfg = flashmem.FlashMemoryConfig(**{**SMALL, **KW, **EVERY, "lsa_rerank_mirror": "int8"})

    def step_reads() -> int:
        with flashmem.attach(model, cfg) as cache, torch.no_grad():
            model(ids, cache=cache, use_cache=True)
            before = cache.traffic_report()["totals"]["host_read_bytes"]
            model(ids[:, -1:], cache=cache, use_cache=True)
            return cache.traffic_report()["totals"]["host_read_bytes"] - before

    whole = step_reads()
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES_CPU", 1)
    assert step_reads() == 2 * whole > 0
