"""The working set held as int8 on the device (`working_set_codec: int8`)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.compress import page_code
from flashmem.errors import ConfigError
from flashmem.sizing.budget import budget_config, predicted_ratio
from flashmem.sizing.tiers import working_set_bytes_per_element
from test_cache import ALL_EXACT, reference, run
from tiny_models import tiny_llama

torch.set_num_threads(1)


def test_codes_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 64, generator=g) * torch.rand(2, 3, 40, 1, generator=g) * 10
    x[0, 0, 0] = 0.0  # an all-zero row decodes to zeros
    codes, scale = page_code.encode(x)
    assert codes.dtype == torch.int8 and scale.shape == (2, 3, 40, 1)
    back = page_code.decode(codes, scale, torch.float32)
    assert torch.all((back - x).abs() <= scale / 2 + 1e-6)
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    # coding and decoding in one pass gives the same codes and values, in any dtype
    for dtype in (torch.float32, torch.bfloat16):
        c1, s1, plain = page_code.encode_and_decode(x, dtype)
        assert torch.equal(c1, codes) and torch.equal(s1, scale)
        assert plain is not None and torch.equal(plain, page_code.decode(codes, scale, dtype))
    # decoding and coding again changes nothing (a kept page is not coded twice over)
    codes2, scale2 = page_code.encode(back)
    assert torch.equal(codes2, codes) and torch.allclose(scale2, scale)
    assert working_set_bytes_per_element("int8", 64, 4) == pytest.approx(1 + 4 / 64)
    assert working_set_bytes_per_element("model", 64, 2) == 2


def _logits_and_ws_bytes(model, ids, **kw):
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**ALL_EXACT, **kw))
    try:
        out = run(model, cache, ids, 8)
        ws = sum(layer.resident_bytes()["working_set"] for layer in cache.layers)
        # a step's decoded copy is a transient: nothing uncounted stays resident after it
        assert all(layer.working_set.plain == [None, None] for layer in cache.layers)
    finally:
        cache.close()
    return out, ws


def test_int8_working_set_stays_close_to_dense_at_a_quarter_of_the_bytes():
    """Every page selected: the model-dtype working set is exact; the int8 one differs
    from it (it is coded) by a small error, and holds (1 + 4/d) / 4 of its bytes."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    ref = reference(model, ids, 8)
    exact, ws_exact = _logits_and_ws_bytes(model, ids)
    coded, ws_coded = _logits_and_ws_bytes(model, ids, working_set_codec="int8")
    assert torch.allclose(exact, ref, atol=1e-4)
    err = (coded - ref).abs().max().item()
    assert 0 < err < 0.05 * ref.abs().max().item()
    d = model.config.hidden_size // model.config.num_attention_heads
    assert ws_coded == pytest.approx(ws_exact * (1 + 4 / d) / 4, rel=1e-6)


@pytest.mark.parametrize("tokens", [4096, 8192])
@pytest.mark.parametrize("budget", [1 / 8, 1 / 16])
def test_the_budget_buys_more_pages_with_an_int8_working_set(tokens, budget):
    geo = {"group": 3, "head_dim": 64, "dtype_bytes": 4}
    plain = budget_config(budget, tokens, variant="wsmodel", **geo)
    coded = budget_config(budget, tokens, **geo)  # the recipe
    assert coded.working_set_codec == "int8" and plain.working_set_codec == "model"
    assert predicted_ratio(coded, tokens, **geo) <= 1.03 * budget
    assert coded.lsa_top_k >= 2.5 * plain.lsa_top_k
    # counted at the model's dtype, the same pages would be far over the budget
    assert predicted_ratio(coded.model_copy(update={"working_set_codec": "model"}), tokens, **geo) > 1.5 * budget


def test_a_bad_working_set_codec_is_a_one_line_error():
    with pytest.raises(ConfigError) as e:
        flashmem.FlashMemoryConfig(working_set_codec="int4")
    assert "working_set_codec" in str(e.value) and "int8" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("rerank, through", [(1, False), (4, False), (10_000, False), (1, True)])
def test_pages_held_over_keep_their_codes_as_if_coded_again(monkeypatch, rerank, through):
    """A step codes only the pages its working set did not hold: held pages keep their
    codes, which are what coding them again gives (per-token scales), so the logits are
    those of coding the whole working set every step. Direct reads, re-rank candidates,
    every page as a candidate and whole blocks through the prefetcher each take that path."""
    from flashmem.cache.flash_layer import FlashLayer
    from flashmem.cache.working_set import WorkingSet
    from test_rerank import _run

    monkeypatch.setattr(FlashLayer, "read_memory_directly", not through)

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(8))
    kw = dict(lsa_scorer="mean_key", lsa_page_tokens=4, lsa_index_dtype="int8", lsa_top_k=6)
    kw.update(lsa_rerank=min(rerank, 4), lsa_rerank_min_pages=rerank if rerank > 4 else 0, working_set_codec="int8")
    merge, merged = WorkingSet.merge, []

    def counting(self, idx, held, *a):
        merged.append(int((~held[0]).sum()))
        return merge(self, idx, held, *a)

    monkeypatch.setattr(WorkingSet, "merge", counting)
    kept_out, kept = _run(model, ids, 8, **kw)
    assert merged and any(n > 0 for n in merged)  # pages held over and pages read fresh
    monkeypatch.setattr(WorkingSet, "held_over", lambda self, *a: None)  # code every page every step
    again_out, again = _run(model, ids, 8, **kw)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(kept, again))
    # held pages may sit in other slots (an in-place merge), so attention sums in another order
    torch.testing.assert_close(kept_out, again_out, rtol=0, atol=1e-6)


def test_attention_buffers_are_reused_by_a_threads_caches_and_reported_apart():
    """Attention's keys, values and mask are assembled in buffers every cache a thread runs
    shares and reuses step after step (no fresh allocation per layer), reported as
    scratch_bytes apart from the resident tiers; another thread has its own."""
    import threading

    from flashmem.cache.scratch import Scratch, thread_scratch

    scratch = Scratch()
    a = scratch.take("keys", (1, 2, 10, 4), torch.float32, torch.device("cpu"))
    b = scratch.take("keys", (1, 2, 8, 4), torch.float32, torch.device("cpu"))
    assert a.data_ptr() == b.data_ptr()  # the same memory, reused
    c = scratch.take("values", (1, 2, 8, 4), torch.float32, torch.device("cpu"))
    assert c.data_ptr() != a.data_ptr()
    assert scratch.nbytes() == (80 + 20 + 64 + 16) * 4  # each with a quarter to spare
    other: list[Scratch] = []
    worker = threading.Thread(target=lambda: other.append(thread_scratch()))
    worker.start()
    worker.join()
    assert other[0] is not thread_scratch() and thread_scratch() is thread_scratch()

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    thread_scratch().clear()
    cfg = flashmem.FlashMemoryConfig(**ALL_EXACT, working_set_codec="int8")
    first, second = flashmem.attach(model, cfg), flashmem.attach(model, cfg)
    try:
        run(model, first, ids, 4)
        held = thread_scratch().nbytes()
        assert held > 0 and first.memory_report()["scratch_bytes"] == held
        run(model, second, ids, 4)  # the same steps: the second cache reuses the buffers
        assert thread_scratch().nbytes() == held
        report = second.memory_report()
        assert report["device_resident_bytes"] == (
            report["managed_resident_bytes"] + report["full_layer_bytes"] + report["sliding_layer_bytes"]
        )
    finally:
        first.close()
        second.close()


def test_a_forward_outside_no_grad_runs_and_matches_and_backpropagates():
    """A caller who forgets torch.no_grad (or wants gradients) gets the same logits as under
    it, and backward runs: under autograd no out= write and no shared buffer is used."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    cfg = flashmem.FlashMemoryConfig(**{**ALL_EXACT, "lsa_top_k": 2}, working_set_codec="int8")
    logits = []
    for grad in (False, True):
        cache = flashmem.attach(model, cfg)
        try:
            with torch.set_grad_enabled(grad):
                for s in range(0, 192, 64):  # sealed blocks, then single steps over the int8 pages
                    model(input_ids=ids[:, s : s + 64], cache=cache, use_cache=True)
                out = [model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(192, 196)]
            logits.append(torch.cat(out, 1))
        finally:
            cache.close()
    assert not logits[0].requires_grad and logits[1].requires_grad
    assert torch.allclose(logits[0], logits[1].detach(), atol=1e-5)
    logits[1].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_decode_an_accelerator_takes_gives_the_cpus_buffer(monkeypatch, dtype):
    """assembly.concat decodes int8 parts in one mixed-dtype multiply where `one_pass_decode`
    says so (an accelerator) and by a copy and a scale pass on a CPU: the same buffer, bit for
    bit, in fp32 and bf16, beside a model-dtype part."""
    from flashmem.cache import assembly

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 40, 16, generator=g) * torch.rand(2, 3, 40, 1, generator=g) * 8
    plain = torch.randn(2, 3, 5, 16, generator=g).to(dtype)
    codes, scale = page_code.encode(x)

    def build(one_pass: bool) -> torch.Tensor:
        monkeypatch.setattr(assembly, "one_pass_decode", lambda device: one_pass)
        calls = []
        mul = torch.mul
        monkeypatch.setattr(torch, "mul", lambda *a, **kw: calls.append(1) or mul(*a, **kw))
        with torch.no_grad():  # (under autograd parts are decoded, then concatenated)
            out = assembly.concat([plain, (codes, scale)], lambda shape: torch.full(shape, float("nan"), dtype=dtype))
        monkeypatch.setattr(torch, "mul", mul)
        assert len(calls) == int(one_pass)
        return out

    assert not assembly.one_pass_decode(torch.device("cpu"))
    cpu, one = build(False), build(True)
    assert cpu.dtype == one.dtype == dtype and cpu.shape == (2, 3, 45, 16)
    assert torch.equal(one, cpu)
    assert torch.equal(one[:, :, 5:], page_code.decode(codes, scale, dtype))


@pytest.mark.parametrize(
    "dtype, width, offset",
    [(torch.int8, 64, 0), (torch.int8, 64, 8), (torch.int8, 12, 0), (torch.int8, 64, 3), (torch.float32, 16, 0)],
    ids=["int8-words", "int8-words-at-8", "int8-narrow", "int8-unaligned", "fp32"],
)
def test_copy_rows_writes_what_index_copy_writes(dtype, width, offset):
    """page_code.copy_rows (int8 rows as int64 words where their width and alignment allow, else
    index_copy_) leaves the destination as index_copy_ does, views into a larger buffer included,
    and the bytes around it untouched."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-100, 100, (20 * width + offset,), generator=g).to(dtype)
    rows = torch.tensor([7, 2, 11, 0])
    src = torch.randint(-100, 100, (4, width), generator=g).to(dtype)
    want = base.clone()
    want[offset:].view(20, width).index_copy_(0, rows, src)
    got = base.clone()
    page_code.copy_rows(got[offset:].view(20, width), rows, src)
    assert torch.equal(got, want)
