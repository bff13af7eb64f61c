"""The re-rank scored by a code of the candidates' keys (`lsa_rerank_codec`)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.compress import key_code
from test_rerank import _run
from tiny_models import tiny_llama

torch.set_num_threads(1)
KW = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=3, lsa_rerank=4)


@pytest.mark.parametrize("codec", ["int4", "int2", "sign"])
def test_codes_pack_and_decode_within_their_step(codec):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 64, 32, generator=g) * torch.linspace(0.1, 4, 32)  # channels of different ranges
    code = key_code.encode(k, codec)
    bits = {"int4": 4, "int2": 2, "sign": 1}[codec]
    assert code.q.dtype == torch.uint8 and code.q.shape == (2, 3, 64, 32 * bits // 8)
    assert code.zero.shape == code.scale.shape == (2, 3, 1, 32)
    q = key_code._unpack(code.q, bits)
    assert int(q.max()) <= (1 << bits) - 1
    assert torch.equal(key_code._pack(q, bits), code.q)  # packing is lossless
    kh = key_code.decode(code)
    if codec == "sign":
        # each element is its channel's mean plus or minus the mean absolute deviation
        mu = k.mean(-2, keepdim=True)
        dev = (k - mu).abs().mean(-2, keepdim=True)
        want = torch.where(k > mu, mu + dev, mu - dev)
        assert torch.allclose(kh, want, atol=2e-2 * float(k.abs().max()))
    else:  # min/max quantization: off by at most half a step (fp16 zero and scale rounding aside)
        step = code.scale.float()
        assert bool(((kh - k).abs() <= step / 2 + 1e-2 * step + 1e-3).all())


def test_every_page_selected_gives_the_same_logits_with_each_code():
    """With top-k over every page the code cannot change what attention reads."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    every = dict(KW, lsa_top_k=10_000)
    exact, _ = _run(model, ids, 4, **every)
    for codec in ("int4", "int2", "sign"):
        coded, _ = _run(model, ids, 4, **every, lsa_rerank_codec=codec)
        assert torch.allclose(exact, coded, atol=1e-5), codec


@pytest.mark.parametrize("codec", ["int4", "int2", "sign"])
def test_coded_mass_finds_the_needle_page_and_int4_follows_the_exact_mass(codec):
    """64 pages of 16 Gaussian keys, one token in every 8th page aligned with the query as a needle's
    is: every code ranks first the page the exact keys rank first; int4's page masses follow
    the exact ones closely."""
    from flashmem.index.rerank import exact_page_mass

    g = torch.Generator().manual_seed(1)
    d, P, n = 64, 16, 64
    q = torch.randn(d, generator=g)
    keys = torch.randn(n * P, d, generator=g) * torch.linspace(0.3, 2.0, d)
    for j in range(0, n, 8):
        keys[j * P + 5] += (6.0 if j != 24 else 8.0) * q / q.norm()
    blocks = keys.reshape(n // 4, 4 * P, d)  # 64-token blocks, coded as the cache codes them
    coded = key_code.decode(key_code.encode(blocks, codec)).reshape(1, 1, n, P, d)
    qg, valid = q[None, None, None], torch.ones(1, 1, n, P, dtype=torch.bool)
    exact = exact_page_mass(qg, keys.reshape(1, 1, n, P, d), valid, d**-0.5)[0, 0]
    mass = exact_page_mass(qg, coded, valid, d**-0.5)[0, 0]
    assert int(mass.argmax()) == int(exact.argmax())
    if codec == "int4":
        assert torch.corrcoef(torch.stack([exact, mass]))[0, 1] > 0.95


def test_coded_rerank_reads_only_the_candidates_codes():
    """Per decode step and layer: c candidate pages x P tokens x h heads x d * bits/8 bytes of
    codes, and an fp16 zero and scale per channel for each candidate page's block (b = 1),
    counted as read on the host; no candidate keys cross to the device."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(5))
    cfg = flashmem.FlashMemoryConfig(
        **{**__import__("test_cache").SMALL, **KW, "lsa_rerank_codec": "int2", "lsa_rerank_min_pages": 20}
    )
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        cache._traffic.reset()
        for _ in range(3):
            out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
        rep = cache.traffic_report()
        layer = cache.layers[0]
        h, d = layer.sink_k.shape[1], layer.sink_k.shape[-1]
        pages = layer.num_sealed * cfg.pages_per_block
    c = min(max(4 * 3, 20), pages)
    per_layer = c * 4 * h * d * 2 // 8 + c * h * d * 2 * 2
    n_layers = len(cache.layers)
    assert rep["per_decode_step_median"]["host_read_bytes"] == n_layers * per_layer
    assert rep["h2d_over_new_pages_median"] in (None, 1.0)


def test_beam_rows_and_a_restored_state_keep_their_codes():
    """Rows reordered (beam search) reorder the codes with the blocks; a cache whose blocks were
    put in its cold tier without sealing (a restored server state) codes them on first use."""
    from flashmem.serve import state

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(7))
    cfg = flashmem.FlashMemoryConfig(**{**__import__("test_cache").SMALL, **KW, "lsa_rerank_codec": "int4"})
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        codes = cache.layers[0].ranker.codes
        before = codes.q[: codes.n].clone()
        cache.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(cache.layers[0].ranker.codes.q[: codes.n], before.flip(1))
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        mark = state.mark(cache)
        first = model(ids[:1], cache=cache, use_cache=True).logits[:, -1:]
        rec = state.export_delta(cache, mark)
        want = model(first.argmax(-1), cache=cache, use_cache=True).logits
        want_codes = cache.layers[0].ranker.codes.q[: cache.layers[0].ranker.codes.n].clone()
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        state.import_records(cache, [rec])
        assert cache.layers[0].ranker.codes.n == 0  # nothing sealed through this cache yet
        got = model(first.argmax(-1), cache=cache, use_cache=True).logits
        codes = cache.layers[0].ranker.codes
        assert torch.equal(codes.q[: codes.n], want_codes)
    assert torch.allclose(got, want, atol=1e-5)


def test_codes_held_on_the_device_choose_as_host_codes_and_copy_only_new_candidates():
    """lsa_rerank_on_device: the same choice and logits as the codes scored on the host; a step
    copies the codes of the candidates the last step did not hold (none when they are the
    same), and the memory report counts the held codes in the index as the sizing predicts."""
    from flashmem.sizing.tiers import candidate_code_bytes

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(8))
    kw = dict(KW, lsa_rerank_codec="int4")
    host_out, host_sel = _run(model, ids, 5, **kw)
    dev_out, dev_sel = _run(model, ids, 5, **kw, lsa_rerank_on_device=True)
    assert len(host_sel) == len(dev_sel) > 0
    assert all(torch.equal(a[1], b[1]) for a, b in zip(host_sel, dev_sel))
    assert torch.equal(host_out, dev_out)

    cfg = flashmem.FlashMemoryConfig(
        **{**__import__("test_cache").SMALL, **kw, "lsa_rerank_on_device": True, "lsa_rerank_min_pages": 12}
    )
    copied = []
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        out = model(ids, cache=cache, use_cache=True).logits[:, -1:]
        for _ in range(4):
            cache._traffic.reset()
            layer = cache.layers[0]
            prev = None if layer.ranker.device_codes.idx is None else layer.ranker.device_codes.idx.clone()
            out = model(out.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
            now = layer.ranker.device_codes.idx
            new = now.numel() if prev is None or prev.shape != now.shape else int((~torch.isin(now, prev)).sum())
            copied.append((new, cache.traffic_report()["totals"]["h2d_bytes"]))
        h, d = layer.sink_k.shape[1], layer.sink_k.shape[-1]
        per_page = cfg.page_tokens * d * 4 // 8 + 4 * d
        held = layer.ranker.device_codes.nbytes()
        assert held == layer.ranker.device_codes.idx.numel() * per_page
        pages = layer.num_sealed * cfg.pages_per_block
        assert held == h * candidate_code_bytes(cfg, pages, layer.ranker.device_codes.idx.shape[-1] // 4, d, 4)
        assert layer.resident_bytes()["index"] == layer.index.nbytes() + held
    # layer 0's new candidates' codes are part of the step's link bytes (both layers copy theirs)
    assert all(nbytes >= new * per_page for new, nbytes in copied)
    assert any(new < 12 for new, _ in copied)  # some candidates held over


def test_codes_on_the_device_need_a_code():
    with pytest.raises(Exception, match="lsa_rerank_on_device: true holds the candidates' codes"):
        flashmem.FlashMemoryConfig(lsa_rerank=4, lsa_rerank_on_device=True)


def _arena(blocks: int = 6, b: int = 2, h: int = 3, B: int = 16, P: int = 4, d: int = 8):
    from flashmem.cache.rerank_codes import RerankCodes

    arena = RerankCodes("int4", B, P)
    arena.extend(torch.randn(b, h, blocks * B, d, generator=torch.Generator().manual_seed(3)))
    return arena, blocks * B // P


def test_device_candidates_write_new_codes_into_freed_slots():
    """Over steps whose candidates change, each candidate's slot holds its own codes, only the
    candidates the last step lacked are copied, and the held codes never grow past the
    candidates (slots of dropped pages are reused in place)."""
    from flashmem.cache.rerank_codes import DeviceCandidates

    arena, pages = _arena()
    held, g = DeviceCandidates(), torch.Generator().manual_seed(4)
    prev: torch.Tensor | None = None
    for step, c in enumerate([5, 5, 7, 7, 7, 6]):
        cand = torch.rand(2, 3, pages, generator=g).argsort(-1)[..., :c].sort(-1).values
        if step == 4:
            cand = prev  # the same candidates again: nothing crosses
        code, slots, nbytes, copied = held.update(cand, arena, torch.device("cpu"))
        want, want_bytes = arena.pages(cand)
        for got_t, want_t in ((code.q, want.q), (code.zero, want.zero), (code.scale, want.scale)):
            at = slots[..., None, None].expand(*slots.shape, *got_t.shape[-2:])
            assert torch.equal(got_t.gather(2, at), want_t)
        assert torch.equal(held.idx.gather(-1, slots), cand)
        assert len(set(slots[0, 0].tolist())) == c  # one slot per candidate
        if prev is None:
            assert copied == cand.numel() and nbytes == want_bytes
        elif step == 4:
            assert copied == nbytes == 0
        else:
            hits = sum(int(torch.isin(cand[i, j], prev[i, j]).sum()) for i in range(2) for j in range(3))
            assert copied == cand.numel() - hits
            assert nbytes == copied * want_bytes // cand.numel()
        assert held.idx.shape[-1] == max(5, 7 if step >= 2 else 5)
        prev = cand


@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
def test_coded_page_mass_is_the_same_in_chunks_and_from_slots(chunk):
    """Decoding a chunk of candidates at a time (and gathering them from slots) scores as the
    whole decode does."""
    from flashmem.index.rerank import coded_page_mass, exact_page_mass

    arena, pages = _arena()
    g = torch.Generator().manual_seed(5)
    cand = torch.rand(2, 3, pages, generator=g).argsort(-1)[..., :9].sort(-1).values
    code, _ = arena.pages(cand)
    qg = torch.randn(2, 3, 4, 8, generator=g)
    valid = torch.rand(2, 3, 9, 4, generator=g) > 0.2
    want = exact_page_mass(qg, key_code.decode(code), valid, 0.3)
    got = coded_page_mass(qg, code, valid, 0.3, chunk_elements=chunk * 2 * 3 * 4 * 8)
    assert torch.allclose(got, want, atol=1e-6)
    perm = torch.rand(2, 3, 9, generator=g).argsort(-1)  # the codes held in shuffled slots
    inv = perm.argsort(-1)
    shuffled = key_code.KeyCode(
        *(t.gather(2, perm[..., None, None].expand_as(t)) for t in (code.q, code.zero, code.scale)), code.bits
    )
    got = coded_page_mass(qg, shuffled, valid, 0.3, slots=inv, chunk_elements=chunk * 2 * 3 * 4 * 8)
    assert torch.allclose(got, want, atol=1e-6)


def test_device_codes_that_leave_no_page_are_refused():
    """At 4K and 1/16 the 256-page floor's codes fill the budget: a config that re-ranks but can
    select nothing is refused with a one-line error, not returned with lsa_top_k 0."""
    from flashmem.errors import FlashMemError
    from flashmem.sizing.budget import budget_config

    with pytest.raises(FlashMemError, match="leave no room for a selected page.*allowed"):
        budget_config(1 / 16, 4096, lsa_rerank_codec="int4", lsa_rerank_on_device=True)
    held = budget_config(1 / 8, 8192, lsa_rerank_codec="int4", lsa_rerank_on_device=True)
    assert 0 < held.lsa_top_k < budget_config(1 / 8, 8192).lsa_top_k  # the codes' bytes bought fewer pages


def test_the_recipe_holds_codes_past_the_cap_unless_the_caller_or_variant_names_a_codec():
    from flashmem.recipe import DEVICE_RERANK
    from flashmem.sizing.budget import budget_config

    def placement(cfg):
        return cfg.lsa_rerank_codec, cfg.lsa_rerank_on_device

    assert placement(budget_config(1 / 8, 32768)) == tuple(DEVICE_RERANK.values())  # the page cap binds
    assert placement(budget_config(1 / 8, 8192)) == ("exact", False)  # it does not
    assert placement(budget_config(1 / 8, 32768, "rrexact")) == ("exact", False)
    assert placement(budget_config(1 / 8, 32768, "rrcode-int4")) == ("int4", False)
    assert placement(budget_config(1 / 8, 32768, lsa_rerank_codec="sign")) == ("sign", False)


def test_a_model_on_the_cpu_keeps_exact_keys_scored_in_place():
    """On a CPU the device and the cold tier are the same RAM: for_budget(model) does not hold
    codes there (they cost compute and save nothing); the same model elsewhere (meta) does."""
    model = tiny_llama()
    cpu = flashmem.FlashMemoryConfig.for_budget(1 / 8, 32768, model, lsa_layer_shares=None)
    assert (cpu.lsa_rerank_codec, cpu.lsa_rerank_on_device) == ("exact", False)
    meta = flashmem.FlashMemoryConfig.for_budget(1 / 8, 32768, model.to("meta"), lsa_layer_shares=None)
    assert (meta.lsa_rerank_codec, meta.lsa_rerank_on_device) == ("int4", True)
    assert meta.lsa_top_k == cpu.lsa_top_k  # the codes use room the page cap left
