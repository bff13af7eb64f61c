"""Traffic counted per forward (cache/traffic.py), and selection that moves across the link
only what a step newly attends (`BlockReader.host_ranking`)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache.block_reads import BlockReader
from test_cache import SMALL
from tiny_models import tiny_llama

RERANKED = dict(
    SMALL,
    use_summaries=False,
    lsa_scorer="mean_key",
    lsa_page_tokens=4,
    lsa_index_dtype="int8",
    lsa_top_k=6,
    lsa_rerank=4,
    prefetch_threads=0,
)


def _decode(model, cache, ids, steps):
    """Prompt ids[:, :-steps], then `steps` one-token forwards; -> logits, selections per step."""
    sels = []
    with torch.no_grad():
        out = [model(ids[:, :-steps], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(ids.shape[1] - steps, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
            sels.append([layer.ws_idx.clone() for layer in cache.flash_layers])
    return torch.cat(out), sels


def test_decode_traffic_matches_bytes_worked_out_by_hand():
    """Every page selected, no re-rank: a decode step reads every resident tier of every
    layer and the new token (device), and copies from the cold tier only pages it did not
    hold the step before (none once the selection is stable); a full cache reads every token."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    cfg = flashmem.FlashMemoryConfig(**SMALL, use_summaries=False, lsa_keep_ratio=1.0, prefetch_threads=0)
    cache = flashmem.attach(model, cfg)
    with torch.no_grad():
        model(ids[:, :100], cache=cache, use_cache=True)
        model(ids[:, 100:101], cache=cache, use_cache=True)  # selects every page: reads them all
        report = cache.traffic_report()
        before, pages_before = report["totals"], report["page_cache"]
        model(ids[:, 101:102], cache=cache, use_cache=True)  # the same pages: held, nothing copied
    after = cache.traffic_report()
    layers = cache.flash_layers
    # the last step found every page of every layer and KV head held, and missed none
    held = sum(layer.ws_idx.numel() for layer in layers)
    assert held == sum(layer.num_sealed * cfg.pages_per_block * layer.sink_k.shape[1] for layer in layers) > 0
    assert after["page_cache"]["hits"] - pages_before["hits"] == held
    assert after["page_cache"]["misses"] == pages_before["misses"]
    h, d = layers[0].sink_k.shape[1], layers[0].sink_k.shape[-1]
    per_token = 2 * h * d * 4  # K and V, fp32, one layer
    resident = sum(sum(n for k, n in layer.resident_bytes().items() if k != "prefill_kv") for layer in layers)
    device = after["totals"]["device_read_bytes"] - before["device_read_bytes"]
    assert device == resident  # = the tiers during the step (101 tokens) + the new token's K/V
    assert after["totals"]["h2d_bytes"] == before["h2d_bytes"]  # every page held over
    # attention's buffer: all 102 tokens' K and V (every page selected, plus the new token), fp32,
    # written and read back by SDPA, in every layer; a model-dtype index is not converted
    copied = after["totals"]["device_copy_bytes"] - before["device_copy_bytes"]
    assert copied == len(layers) * 2 * 102 * per_token
    assert after["per_decode_step_median"]["full_cache_bytes"] > 0
    assert after["steps"] == {"prefill_forwards": 1, "decode_steps": 2, "redo_forwards": 0, "redo_tokens": 0}
    # a full cache reads all 102 tokens in every layer at the last step
    assert cache.full_cache_bytes(102) == 102 * per_token * len(model.model.layers)
    assert after["page_cache"]["hits"] > 0


def test_a_decode_step_copies_exactly_the_pages_it_did_not_hold():
    """The working set is the device's page cache: a step reads from the cold tier only the
    selected pages the last step's working set did not hold, K and V, in the model's dtype."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 140), generator=torch.Generator().manual_seed(2))
    cfg = flashmem.FlashMemoryConfig(**SMALL, use_summaries=False, lsa_top_k=3, lsa_page_tokens=4, prefetch_threads=0)
    cache = flashmem.attach(model, cfg)
    layers = cache.flash_layers
    moved = []
    with torch.no_grad():
        model(ids[:, :100], cache=cache, use_cache=True)
        page_bytes = 2 * 4 * layers[0].sink_k.shape[-1] * 4  # K and V of a 4-token page of one head, fp32
        for t in range(100, 140):
            prev = [layer.ws_idx.clone() for layer in layers]
            h2d = cache.traffic_report()["totals"]["h2d_bytes"]
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
            new = sum(
                int((~(layer.ws_idx[..., :, None] == p[..., None, :]).any(-1)).sum()) for layer, p in zip(layers, prev)
            )
            total = sum(layer.ws_idx.numel() for layer in layers)
            moved.append((new, total, cache.traffic_report()["totals"]["h2d_bytes"] - h2d))
    assert any(new for new, _, _ in moved) and any(new < total for new, total, _ in moved)  # some held over
    assert all(copied == new * page_bytes for new, _, copied in moved)
    report = cache.traffic_report()  # the same figure, as the report gives it per step
    assert report["h2d_over_new_pages_median"] == 1.0
    assert report["per_decode_step_median"]["new_page_bytes"] % page_bytes == 0


@pytest.mark.parametrize(
    "floor, store, threads", [(0, "memory", 0), (10_000, "memory", 0), (0, "disk", 0), (0, "memory", 2), (0, "disk", 2)]
)
@pytest.mark.parametrize("codec", ["model", "int8"])
def test_candidates_ranked_on_the_host_choose_the_same_and_copy_only_new_pages(
    monkeypatch, tmp_path, floor, store, threads, codec
):
    """`host_ranking` (on by itself on an accelerator; forced here on the CPU): the re-rank reads
    candidates' keys where the cold tier holds them (a memory store's arena, or a disk store's
    blocks read into host memory), so the choice and the logits are those of the default path,
    and what is copied to the device per decode step is the pages that newly enter the working
    set (at most 1.5x their bytes), not the candidates or their whole blocks."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(6))
    where = {"cold_store": "disk", "cold_dir": str(tmp_path / "cold")} if store == "disk" else {}
    # threads: through the prefetcher, which then stages blocks in host memory
    keys = {**RERANKED, "prefetch_threads": threads, "working_set_codec": codec}
    cfg = flashmem.FlashMemoryConfig(**keys, lsa_rerank_min_pages=floor, **where)
    ref_out, ref_sel = _decode(model, flashmem.attach(model, cfg), ids, 8)
    monkeypatch.setattr(BlockReader, "rank_on_host", True)
    cache = flashmem.attach(model, cfg)
    steps = []
    with torch.no_grad():
        out = [model(ids[:, :-8], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(ids.shape[1] - 8, ids.shape[1]):
            prev = [layer.ws_idx.clone() for layer in cache.flash_layers]
            h2d = cache.traffic_report()["totals"]["h2d_bytes"]
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
            new = sum(
                int((~(layer.ws_idx[..., :, None] == p[..., None, :]).any(-1)).sum())
                for layer, p in zip(cache.flash_layers, prev)
            )
            steps.append((new, cache.traffic_report()["totals"]["h2d_bytes"] - h2d))
    assert torch.allclose(torch.cat(out), ref_out, atol=1e-5)
    layer = cache.flash_layers[0]
    page_bytes = 2 * 4 * layer.sink_k.shape[-1] * 4  # K and V of one 4-token page of one head, fp32
    assert any(new > 0 for new, _ in steps)
    # an int8 working set's new pages cross as codes + one fp32 scale per token: (d + 4) / (4 d)
    d = layer.sink_k.shape[-1]
    per_page = page_bytes if codec == "model" else 2 * 4 * (d + 4)
    for new, copied in steps:
        assert copied == new * per_page
    report = cache.traffic_report()
    assert report["per_decode_step_median"]["host_read_bytes"] > 0  # the candidates, read where they lie
    assert report["h2d_over_new_pages_median"] == pytest.approx(per_page / page_bytes)
    assert 0 < report["page_cache"]["hit_rate"] < 1


@pytest.mark.parametrize("store, threads", [("memory", 0), ("disk", 0), ("memory", 2), ("disk", 2)])
def test_every_page_selected_and_ranked_on_the_host_is_the_full_cache(monkeypatch, tmp_path, store, threads):
    """Exactness of the host-side path: with every page selected (nothing left to rank; the
    pages cut on the host and copied to the device, from a memory or disk cold tier, with or
    without the prefetcher) decoding gives DynamicCache's logits."""
    from test_cache import reference, run

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 260), generator=torch.Generator().manual_seed(11))
    ref = reference(model, ids, 12)
    monkeypatch.setattr(BlockReader, "rank_on_host", True)
    where = {"cold_store": "disk", "cold_dir": str(tmp_path / "cold")} if store == "disk" else {}
    keys = {**RERANKED, "lsa_top_k": 10_000, "prefetch_threads": threads}
    out = run(model, flashmem.attach(model, flashmem.FlashMemoryConfig(**keys, **where)), ids, 12)
    assert (out - ref).abs().max() <= 1e-4


def test_past_lsa_rerank_max_tokens_the_index_choice_stands_and_no_keys_are_read():
    """`lsa_rerank_max_tokens`: once more tokens are sealed the re-rank is off, so decoding
    selects as `lsa_rerank: 1` does and reads no candidate keys; below it, the re-rank runs."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(12))
    plain_out, plain_sel = _decode(
        model, flashmem.attach(model, flashmem.FlashMemoryConfig(**RERANKED | {"lsa_rerank": 1})), ids, 6
    )
    capped = flashmem.attach(model, flashmem.FlashMemoryConfig(**RERANKED, lsa_rerank_max_tokens=64))
    out, sel = _decode(model, capped, ids, 6)
    assert torch.allclose(out, plain_out, atol=1e-6)
    assert all(torch.equal(a, b) for step_a, step_b in zip(sel, plain_sel) for a, b in zip(step_a, step_b))
    assert capped.traffic_report()["per_decode_step_median"]["host_read_bytes"] == 0
    on = flashmem.attach(model, flashmem.FlashMemoryConfig(**RERANKED, lsa_rerank_max_tokens=10_000))
    _decode(model, on, ids, 6)
    assert on.traffic_report()["per_decode_step_median"]["host_read_bytes"] > 0


def test_copies_counted_for_an_int8_working_set_and_index():
    """device_copy_bytes counts what a selecting step writes and reads back beside its tiers: the
    K/V buffer attention reads (every attended token, in the model's dtype), on a CPU an int8
    working set's second (scale) pass over its decoded bytes, and an int8 index converted to the
    queries' dtype; the counted hardware traffic adds them to the device's reads."""
    from flashmem.sizing import hardware as hwm

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(3))
    cfg = flashmem.FlashMemoryConfig(**{**RERANKED, "working_set_codec": "int8"})
    cache = flashmem.attach(model, cfg)
    layers = cache.flash_layers
    with torch.no_grad():
        model(ids[:, :150], cache=cache, use_cache=True)
        before = cache.traffic_report()["totals"]["device_copy_bytes"]
        # the step's own tiers (its append may seal a block and index it after it has attended)
        recent = [lay.sink_k.shape[-2] + lay.open_k.shape[-2] + lay.win_k.shape[-2] + 1 for lay in layers]
        index = [lay.ranker.index.codes.numel() for lay in layers]
        model(ids[:, 150:151], cache=cache, use_cache=True)
    report = cache.traffic_report()
    copied = report["totals"]["device_copy_bytes"] - before
    want = 0
    for layer, r, n in zip(layers, recent, index):
        b, h, _, d = layer.sink_k.shape
        ws = layer.working_set.idx.shape[-1] * cfg.page_tokens  # selected tokens per KV head
        # the int8 pages decoded: the buffer written and read, plus the scale pass (read and write)
        want += 2 * 2 * b * h * (ws + r) * d * 4 + 2 * 2 * b * h * ws * d * 4
        want += 2 * n * 4  # int8 mean keys converted to fp32
    assert copied == want > 0
    # counted traffic for the hardware model: the copies are HBM traffic too
    tr = hwm.counted_traffic(report, 1, 0, "test")
    step = report["per_decode_step_median"]
    assert tr.device_read_bytes == step["device_read_bytes"] + step["device_copy_bytes"]
    assert tr.assembly_bytes == step["device_copy_bytes"]


def test_counts_handed_over_as_tensors_are_read_when_the_step_closes():
    """Page and candidate hits counted on the device are kept as tensors (reading them in each
    layer would make the host wait for the device) and read when the step closes."""
    from flashmem.cache.traffic import Traffic

    t = Traffic()
    t.begin_step(1, 10, 100)
    t.pages(torch.tensor(3), torch.tensor(5), 7)
    t.pages(1, 2, 7)  # plain ints as before
    t.candidates(torch.tensor(2), 4)
    first = t.steps[0]
    assert first.page_hits == 1 and first.lazy  # not read yet
    t.begin_step(1, 11, 100)  # closes the first step
    assert not first.lazy
    got = (first.page_hits, first.page_misses, first.new_page_bytes, first.candidate_hits, first.candidate_misses)
    assert got == (4, 7, 49, 2, 4)
    t.pages(torch.tensor(6), torch.tensor(0), 7)
    report = t.report()  # closes the open one too
    assert report["page_cache"]["hits"] == 10 and report["page_cache"]["misses"] == 7


def test_a_redo_on_doubt_is_counted_apart_and_reads_every_sealed_block():
    """exact_on_doubt: a redone decode step is its decode step plus a redo forward counted apart,
    so the prompt's and the decode steps' counts are those of the same run without the key; the
    redo streams every sealed block of every layer from the cold tier (K and V, fp32); with every
    step redone, each redo feeds again only its own token (the last exact point is the step before)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    base = dict(SMALL, lsa_top_k=1, prefill_exact_tokens=4096, prefetch_threads=0)
    reports = {}
    for name, keys in (("plain", {}), ("doubt", dict(exact_on_doubt=20.0, exact_on_doubt_share=1.0))):
        cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**base, **keys))
        with torch.no_grad():
            model(ids[:, :100], cache=cache, use_cache=True)
            for t in range(100, 103):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
        reports[name] = cache.traffic_report()
    plain, doubt = reports["plain"], reports["doubt"]
    assert doubt["steps"] == dict(plain["steps"], redo_forwards=3, redo_tokens=3)
    assert doubt["per_prefill_forward_median"] == plain["per_prefill_forward_median"]
    layers = cache.flash_layers
    h, d = layers[0].sink_k.shape[1], layers[0].sink_k.shape[-1]
    sealed = sum(layer.num_sealed for layer in layers) * layers[0].cfg.hca_chunk_size  # none sealed in 3 steps
    assert doubt["per_redo_forward_median"]["h2d_bytes"] == sealed * 2 * h * d * 4 > 0
    assert plain["per_redo_forward_median"]["h2d_bytes"] == 0


@pytest.mark.parametrize("codec", ["model", "int8"])
def test_the_candidates_keys_are_freed_before_the_working_sets_values_are_read(monkeypatch, tmp_path, codec):
    """A disk tier's re-rank reads its candidates' keys and cuts the working set's out of them;
    the rest go before the winners' values are read, so a first decode step (every page new)
    does not hold the candidates' keys, the pages' K/V and their coding at once (stop 66)."""
    import weakref

    from flashmem.cache.ranking import CandidateRanker

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(6))
    cfg = flashmem.FlashMemoryConfig(
        **{**RERANKED, "working_set_codec": codec}, cold_store="disk", cold_dir=str(tmp_path / "cold")
    )
    ref, _ = _decode(model, flashmem.attach(model, cfg), ids, 4)
    read_keys = CandidateRanker._read_candidates
    read_pages = BlockReader.arena_pages
    cand_keys: list[weakref.ref] = []
    alive_at_values: list[bool] = []

    def candidates(self, idx):
        k, v = read_keys(self, idx)
        cand_keys.append(weakref.ref(k))
        return k, v

    def pages(self, idx, keys=True, values=True, **kw):
        if not keys and cand_keys:  # the working set's values: the last candidates' keys are gone
            alive_at_values.append(cand_keys[-1]() is not None)
        return read_pages(self, idx, keys, values, **kw)

    monkeypatch.setattr(CandidateRanker, "_read_candidates", candidates)
    monkeypatch.setattr(BlockReader, "arena_pages", pages)
    out, _ = _decode(model, flashmem.attach(model, cfg), ids, 4)
    assert cand_keys and alive_at_values and not any(alive_at_values)
    assert torch.equal(out, ref)
