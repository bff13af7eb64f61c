"""BatchedCache: several sequences of different lengths in one forward, each row as alone."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache import batched
from flashmem.cache.batched import BatchedCache, forward
from flashmem.cache.scratch import thread_scratch
from flashmem.errors import FlashMemError
from serve_helpers import tiny_cfg, tiny_model
from tiny_models import tiny_gemma3

TOL = 1e-5
# sealed blocks in two rows (each selects its own pages), none in the short one (its decode
# steps attend in the batch's one SDPA); different positions everywhere
LENGTHS = (150, 12, 90)

# exact: the prompt attended exactly and a window that holds every token (nothing selected)
EXACT = tiny_cfg(prefill_exact_tokens=4096, gpu_cache_limit=4096)
CONFIGS = [
    ("llama-exact", tiny_model, EXACT),
    ("llama-selecting", tiny_model, tiny_cfg()),  # sealed blocks, pages selected per row
    ("llama-full-layer", tiny_model, tiny_cfg(keep_full_layers=[0])),  # a plain layer: SDPA per row
    ("gemma3-sliding", tiny_gemma3, tiny_cfg()),  # sliding layers: a windowed mask per row
    # budgets that cover every sealed page: the rows' decode steps share one SDPA (their
    # pages held as alone); summary entries (hidden, counted), then int8 pages and a rest entry
    ("llama-every-page", tiny_model, tiny_cfg(lsa_top_k=64)),
    (
        "llama-every-page-int8",
        tiny_model,
        tiny_cfg(
            lsa_top_k=64,
            lsa_page_tokens=8,
            working_set_codec="int8",
            use_summaries=False,
            csa_band_tokens=0,
            rest_entry=True,
            lsa_rerank=4,
            lsa_open_room=True,
        ),
    ),
]
EVERY_PAGE = {"llama-every-page", "llama-every-page-int8"}


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def _feed(model, cache, tokens: list[int], chunk: int = 32) -> torch.Tensor:
    """Forwards of `tokens` alone (in chunks) -> the logits after the last one."""
    with torch.inference_mode():
        for a in range(0, len(tokens), chunk):
            out = model(torch.tensor([tokens[a : a + chunk]]), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


@pytest.mark.parametrize("name,make,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_batched_decode_gives_each_row_its_logits_alone(name, make, cfg) -> None:
    model, steps = make(), 6
    prompts = _prompts()
    alone: list[list[torch.Tensor]] = []
    alone_caches = []
    for p in prompts:
        cache = flashmem.attach(model, cfg)
        logits = [_feed(model, cache, p)]
        for _ in range(steps):
            logits.append(_feed(model, cache, [int(logits[-1].argmax())]))
        alone.append(logits)
        alone_caches.append(cache)
    rows = [flashmem.attach(model, cfg) for _ in prompts]
    last = [_feed(model, c, p) for c, p in zip(rows, prompts)]
    if name in EVERY_PAGE:  # no row's decode step runs its own layer step: it would fail the row
        for row in rows:
            for layer in row.flash_layers:
                layer.step = _no_own_step
    for s in range(steps):
        batch = BatchedCache(rows)
        out = forward(model, batch, [[int(x.argmax())] for x in last])
        assert not batch.failures
        last = [x for x in out if x is not None]
        for r in range(len(rows)):
            assert (last[r] - alone[r][s + 1]).abs().max().item() <= TOL, (name, r, s)
    assert [c.get_seq_length() for c in rows] == [n + steps for n in LENGTHS]
    for row, ref in zip(rows, alone_caches):  # the same tiers, bytes and traffic as alone
        a, b = row.memory_report(), ref.memory_report()
        assert {k: v for k, v in a.items() if k != "scratch_bytes"} == {
            k: v for k, v in b.items() if k != "scratch_bytes"
        }
        assert row.traffic_report() == ref.traffic_report()
    if name in EVERY_PAGE:  # the long rows held every sealed page (read from their cold tiers)
        for row in (rows[0], rows[2]):
            layer = row.flash_layers[0]
            assert layer.num_sealed > 0 and layer.ws_idx.shape[-1] == layer.num_sealed * cfg.pages_per_block
            assert row.traffic_report()["totals"]["h2d_bytes"] > 0
    if name == "llama-selecting":  # each long row selected pages from its own sealed blocks
        sealed = [c.flash_layers[0].num_sealed for c in rows]
        assert sealed[0] > sealed[2] > 0 == sealed[1]
        assert rows[0].flash_layers[0].ws_idx is not None and rows[2].flash_layers[0].ws_idx is not None


@pytest.mark.parametrize("name,make,cfg", [c for c in CONFIGS if c[0] in EVERY_PAGE], ids=sorted(EVERY_PAGE))
def test_rows_written_into_the_padded_batch_give_their_logits_alone(name, make, cfg, monkeypatch) -> None:
    """From WRITE_MIN_TOKENS padded tokens each row's parts are written into reused buffers
    (int8 pages decoded there, padding zeroed) instead of gathered: the same logits and reports."""
    monkeypatch.setattr(batched, "WRITE_MIN_TOKENS", 0)
    with torch.inference_mode():  # reused buffers that hold NaN: the padding must not read them
        for slot in ("rows_k", "rows_v"):
            thread_scratch().take(slot, (1 << 16,), torch.float32, torch.device("cpu")).fill_(float("nan"))
    written = []
    real = batched._written_kv
    monkeypatch.setattr(batched, "_written_kv", lambda *a: written.append(1) or real(*a))
    test_batched_decode_gives_each_row_its_logits_alone(name, make, cfg)
    assert written


def _no_own_step(*args, **kwargs):
    raise AssertionError("a row that attends every page took its own layer step")


@pytest.mark.parametrize("name,make,cfg", CONFIGS[:1] + CONFIGS[2:], ids=[c[0] for c in CONFIGS[:1] + CONFIGS[2:]])
def test_rows_with_different_token_counts_are_padded_not_cached(name, make, cfg) -> None:
    """A prompt chunk in one row and a decode step in another share a forward (their tokens
    packed): each row caches its own tokens only, and each row's next steps stay exact."""
    model = make()
    prompts = _prompts(1)
    news = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15]]  # 7, 1 and 3 new tokens
    alone, rows = [], []
    for p, new in zip(prompts, news):
        cache = flashmem.attach(model, cfg)
        _feed(model, cache, p)
        a = _feed(model, cache, new, chunk=len(new))
        alone.append((a, _feed(model, cache, [int(a.argmax())])))
        row = flashmem.attach(model, cfg)
        _feed(model, row, p)
        rows.append(row)
    got = forward(model, BatchedCache(rows), news)
    nxt = forward(model, BatchedCache(rows), [[int(x.argmax())] for x in got if x is not None])
    for r in range(3):
        assert got[r] is not None and nxt[r] is not None
        assert (got[r] - alone[r][0]).abs().max().item() <= TOL
        assert (nxt[r] - alone[r][1]).abs().max().item() <= TOL
        assert rows[r].get_seq_length() == LENGTHS[r] + len(news[r]) + 1


def test_rows_join_and_leave_between_forwards() -> None:
    model, cfg = tiny_model(), EXACT
    prompts = _prompts(2)
    caches = [flashmem.attach(model, cfg) for _ in prompts]
    last = [_feed(model, c, p) for c, p in zip(caches, prompts)]
    ref = [flashmem.attach(model, cfg) for _ in prompts]
    ref_last = [_feed(model, c, p) for c, p in zip(ref, prompts)]
    # rows 0 and 1 step together, then row 2 joins, then row 0 leaves
    for live in ([0, 1], [0, 1, 2], [1, 2]):
        toks = [int(last[r].argmax()) for r in live]
        out = forward(model, BatchedCache([caches[r] for r in live]), [[t] for t in toks])
        for r, t, x in zip(live, toks, out):
            assert x is not None
            ref_last[r] = _feed(model, ref[r], [t])
            assert (x - ref_last[r]).abs().max().item() <= TOL
            last[r] = x


@pytest.mark.parametrize("write_min", [None, 0], ids=["catted", "written"])
@pytest.mark.parametrize("cfg", [EXACT, CONFIGS[4][2]], ids=["no-sealed-block", "every-page"])
def test_short_rows_hide_their_own_padding_in_the_shared_attention(cfg, write_min, monkeypatch) -> None:
    """Rows that attend every token they hold and have padding of their own (a left-padded
    prompt: positions that are no token; every-page: inside sealed pages too) attend in one
    SDPA: each hides its padding and the batch's, and gets its logits alone."""
    if write_min is not None:
        monkeypatch.setattr(batched, "WRITE_MIN_TOKENS", write_min)
    model = tiny_model()
    prompts = _prompts(4)
    pads = [5, 0, 37]  # row r's first pads[r] positions are padding
    masks = [torch.tensor([[0] * n + [1] * (len(p) - n)]) for p, n in zip(prompts, pads)]

    def prefill(cache, p, mask) -> torch.Tensor:
        with torch.inference_mode():
            out = model(torch.tensor([p]), attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    rows = [flashmem.attach(model, cfg) for _ in prompts]
    refs = [flashmem.attach(model, cfg) for _ in prompts]
    last = [prefill(c, p, m) for c, p, m in zip(rows, prompts, masks)]
    for c, p, m in zip(refs, prompts, masks):
        prefill(c, p, m)
    if cfg is EXACT:
        assert all(c.flash_layers[0].num_sealed == 0 for c in rows)  # the short path
    else:  # padding in row 2's first sealed pages; no row runs its own layer step
        assert rows[2].flash_layers[0].num_sealed > 1
        for row in rows:
            for layer in row.flash_layers:
                layer.step = _no_own_step
    assert not bool(rows[2].flash_layers[0].valid[0, :37].any())  # the padding is kept as such
    for _ in range(3):
        toks = [int(x.argmax()) for x in last]
        out = forward(model, BatchedCache(rows), [[t] for t in toks])
        for r, (t, x) in enumerate(zip(toks, out)):
            expect = _feed(model, refs[r], [t])
            assert x is not None and (x - expect).abs().max().item() <= TOL, r
        last = [x for x in out if x is not None]


def test_a_failing_row_fails_alone() -> None:
    model, cfg = tiny_model(), EXACT
    prompts = _prompts(3)
    rows = [flashmem.attach(model, cfg) for _ in prompts]
    last = [_feed(model, c, p) for c, p in zip(rows, prompts)]
    ref = flashmem.attach(model, cfg)
    _feed(model, ref, prompts[2])
    rows[1].close()  # its next update raises (a closed cache)
    batch = BatchedCache(rows)
    out = forward(model, batch, [[int(x.argmax())] for x in last])
    assert out[1] is None and list(batch.failures) == [1]
    assert "closed" in str(batch.failures[1])
    expect = _feed(model, ref, [int(last[2].argmax())])
    assert out[2] is not None and (out[2] - expect).abs().max().item() <= TOL


@pytest.mark.parametrize("where", ["bookkeeping", "pages"])
def test_a_row_failing_in_the_shared_short_attention_fails_alone(where) -> None:
    """Rows that attend every token they hold share one SDPA (`batched._attend_short`); one
    whose step bookkeeping raises after it (no sealed block), or whose sealed pages cannot be
    read before it (every page within the budget: a damaged cold block), fails alone, and the
    others' logits are their logits alone."""
    model, cfg = tiny_model(), (EXACT if where == "bookkeeping" else CONFIGS[4][2])
    prompts = _prompts(3)
    rows = [flashmem.attach(model, cfg) for _ in prompts]
    last = [_feed(model, c, p) for c, p in zip(rows, prompts)]
    refs = [flashmem.attach(model, cfg) for _ in prompts]
    for c, p in zip(refs, prompts):
        _feed(model, c, p)
    layer = rows[1].layers[1]

    def broken(*a, **k):
        raise RuntimeError(f"{where} failed")

    if where == "bookkeeping":
        assert layer.num_sealed == 0  # the short path
        layer.finish_step = broken
    else:
        assert rows[0].layers[1].num_sealed > 0 and layer.num_sealed == 0
        layer = rows[0].layers[1]
        layer.working_set.clear()  # its pages to be read again (held pages are not read)
        layer.working_set.gather = broken
    batch = BatchedCache(rows)
    out = forward(model, batch, [[int(x.argmax())] for x in last])
    bad = 1 if where == "bookkeeping" else 0
    assert out[bad] is None and list(batch.failures) == [bad] and where in str(batch.failures[bad])
    assert rows[bad].layers[1].guard.failure is not None  # the row's cache refuses further use
    for r in {0, 1, 2} - {bad}:
        expect = _feed(model, refs[r], [int(last[r].argmax())])
        assert out[r] is not None and (out[r] - expect).abs().max().item() <= TOL


def test_bad_batches_are_one_line_errors() -> None:
    model = tiny_model()
    with pytest.raises(FlashMemError, match="at least one row"):
        BatchedCache([])
    batch = BatchedCache([flashmem.attach(model, EXACT)])
    with pytest.raises(FlashMemError, match="one count >= 1 per row"):
        batch.begin([0])
    with pytest.raises(FlashMemError, match="token lists for a batch of 1"):
        forward(model, batch, [[1], [2]])


def test_rows_with_exact_on_doubt_are_refused():
    """exact_on_doubt's hook undoes a whole forward of one cache: a batch of rows cannot take it."""
    model = tiny_model()
    rows = [flashmem.attach(model, tiny_cfg(prefill_exact_tokens=4096, exact_on_doubt=0.5)) for _ in range(2)]
    with pytest.raises(FlashMemError, match="exact_on_doubt is not allowed in a batch of rows"):
        BatchedCache(rows)
