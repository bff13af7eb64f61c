"""oneDNN's copy of each linear weight, for products of several rows (weight_layout: onednn)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from flashmem.models import onednn_linears
from flashmem.models.weight_layout import auto_layout, linear_layout, set_linear_layout
from tiny_models import tiny_gemma3, tiny_llama

pytestmark = pytest.mark.skipif(not onednn_linears.available(), reason="this torch has no oneDNN")


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.setattr(onednn_linears, "_chosen", {})
    monkeypatch.setattr(onednn_linears, "_trials", {})


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _always(monkeypatch, winner: str) -> list[str]:
    """Make `winner` the faster product in every timed call; -> the products timed, in order."""
    timed: list[str] = []

    def run_timed(name, m, x):
        timed.append(name)
        return onednn_linears._PRODUCT[name](m, x), 1.0 if name == winner else 2.0

    monkeypatch.setattr(onednn_linears, "_run_timed", run_timed)
    return timed


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_onednn_gives_the_same_logits_and_keeps_the_weights(build, monkeypatch):
    model = build()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    _always(monkeypatch, "onednn")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    n = len(_linears(model))

    assert set_linear_layout(model, "onednn") >= n  # the dense ones re-laid as auto does, each given a copy
    assert linear_layout(model) == "onednn"
    assert set_linear_layout(model, "onednn") == 0  # already
    assert onednn_linears.packed_bytes(model) == sum(m.weight.nbytes for m in _linears(model))
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still one tied Parameter
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name  # the weights themselves are untouched
    for _ in range(2 * onednn_linears.TIMED_CALLS):  # the trials of every size end: oneDNN's kept
        with torch.no_grad():
            got = model(ids).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # rounding only: another summation order
    assert set(onednn_linears.chosen_products().values()) == {"onednn"}

    relaid = n if auto_layout(model) == "in_major" else 0  # the dense weights lie as auto lays them
    assert set_linear_layout(model, "out_major") == n + relaid  # the copies dropped, the weights re-laid
    assert linear_layout(model) == "out_major" and onednn_linears.packed_bytes(model) == 0
    assert all("forward" not in m.__dict__ for m in _linears(model))  # nn.Linear's own forward again
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=1e-5)


def test_each_size_takes_turns_then_keeps_the_faster_product(monkeypatch):
    lin = torch.nn.Linear(16, 24)
    onednn_linears.pack(lin)
    timed = _always(monkeypatch, "blas")
    x = torch.randn(5, 16)
    threads = torch.get_num_threads()
    with torch.no_grad():
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        for _ in range(2 * onednn_linears.TIMED_CALLS):  # the first calls of a size take turns, timed
            torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-6)
        assert timed == ["onednn", "blas"] * onednn_linears.TIMED_CALLS
        assert onednn_linears.chosen_products() == {(16, 24, 8, threads): "blas"}
        assert torch.equal(lin(x), want)  # blas kept: the product F.linear gives, to the bit
        lin(torch.randn(7, 16))  # 5 and 7 rows are one size (8)
        lin(torch.randn(2, 3, 16))  # 6 rows in a batch of 2
        assert len(timed) == 2 * onednn_linears.TIMED_CALLS  # nothing timed again
        lin(torch.randn(9, 16))  # 16 rows: another size, in its own trial
        assert len(timed) == 2 * onednn_linears.TIMED_CALLS + 1
        assert (16, 24, 16, threads) not in onednn_linears.chosen_products()

    monkeypatch.setattr(onednn_linears, "_chosen", {})
    monkeypatch.setattr(onednn_linears, "_trials", {})
    _always(monkeypatch, "onednn")
    with torch.no_grad():
        for _ in range(2 * onednn_linears.TIMED_CALLS):
            lin(x)
        got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert onednn_linears.chosen_products()[(16, 24, 8, threads)] == "onednn"


def test_one_row_and_autograd_take_the_dense_weight(monkeypatch):
    lin = torch.nn.Linear(16, 24)
    onednn_linears.pack(lin)

    def refuse(m, x):
        raise AssertionError("the copy was used")

    monkeypatch.setitem(onednn_linears._PRODUCT, "onednn", refuse)
    with torch.no_grad():
        lin(torch.randn(1, 16))
        lin(torch.randn(1, 1, 16))
    x = torch.randn(4, 16, requires_grad=True)
    lin(x).sum().backward()  # grad enabled: F.linear, which autograd differentiates
    assert x.grad is not None and lin.weight.grad is not None
    assert onednn_linears.chosen_products() == {}  # nothing was timed


def test_onednn_refuses_a_model_it_cannot_serve():
    model = tiny_llama().to(torch.float16)
    with pytest.raises(
        ValueError, match="onednn is for float32 or bfloat16 weights on a CPU; the model has torch.float16"
    ):
        set_linear_layout(model, "onednn")
    with pytest.raises(ValueError, match="one of out_major, in_major, onednn"):
        set_linear_layout(model, "packed")


def test_a_packed_model_copies_and_saves_as_before(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    _always(monkeypatch, "onednn")
    model = tiny_llama()
    set_linear_layout(model, "onednn")
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)  # the whole module pickled, as some users keep a loaded model
    buf.seek(0)
    pickled = torch.load(buf, weights_only=False)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        for other in (twin, pickled):
            assert linear_layout(other) == "onednn"
            torch.testing.assert_close(other(ids).logits, want, rtol=0, atol=0)
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    assert linear_layout(again) == "out_major" and auto_layout(again) in ("in_major", "out_major")


def test_the_batched_server_answers_as_alone_with_onednn(monkeypatch):
    """A batch's rows go through oneDNN's product, a sequence alone through the dense one: the
    same greedy tokens, logits within rounding."""
    pytest.importorskip("prometheus_client")
    from flashmem.serve.engine import Engine, Sampling, Sequence
    from flashmem_eval.tiny import tiny_tokenizer
    from serve_helpers import MODEL, tiny_cfg, tiny_model

    _always(monkeypatch, "onednn")
    model = tiny_model()
    set_linear_layout(model, "onednn")
    cfg = tiny_cfg(prefill_exact_tokens=4096, gpu_cache_limit=4096)

    def seq(n: int, s: int) -> Sequence:
        ids = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(s)).tolist()
        q = Sequence(ids, Sampling(max_tokens=6, temperature=0), "t", None)
        q.record_logits = 6
        return q

    engine = Engine(model, tiny_tokenizer(), cfg, model_name=MODEL, max_concurrent=3)
    seqs = [seq(40, 1), seq(17, 2), seq(65, 3)]
    for s in seqs:
        engine.submit(s)
    while not all(s.done.is_set() for s in seqs):
        engine.step()
        engine.wait_admitted()
    assert engine.decode_rows > engine.decode_forwards  # rows shared forwards
    assert set(onednn_linears.chosen_products().values()) == {"onednn"}
    for s, (n, k) in zip(seqs, [(40, 1), (17, 2), (65, 3)]):
        alone = Engine(model, tiny_tokenizer(), cfg, model_name=MODEL).run_sync(seq(n, k))
        assert s.generated == alone.generated
        for x, y in zip(s.logits, alone.logits):
            assert (x - y).abs().max().item() <= 1e-4
