"""The key copy's int8 dot products in each GEMM form, and the form each size is given (cache/int8_dots.py)."""

from __future__ import annotations

import pytest
import torch

from flashmem.cache import int8_dots
from flashmem.cache.rerank_codes import KeyMirror

torch.set_num_threads(1)


def _codes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", int8_dots.FORMS)
@pytest.mark.parametrize(("r", "T", "d", "nq"), [(3, 8192, 64, 3), (2, 100, 24, 1), (1, 64, 16, 9)])
def test_each_form_gives_the_exact_sums(form, r, T, d, nq):
    keys, q = _codes(r, T, d, seed=0), _codes(r, nq, d, seed=1)
    want = torch.einsum("rnd,rtd->rnt", q.long(), keys.long())
    got = int8_dots.dots(keys, q, form)
    assert got.dtype == (torch.float32 if form == "float32" else torch.int32) and got.shape == (r, nq, T)
    assert torch.equal(got.long(), want)


def test_the_float32_form_is_exact_at_the_extremes_and_across_chunks(monkeypatch):
    """Every product at 127 * 127 (or -127 * 127): the largest sums fp32 must hold, and a
    chunk of the keys' conversion smaller than the tokens (several chunks, a ragged last)."""
    monkeypatch.setattr(int8_dots, "FLOAT_CHUNK_ELEMENTS", 2 * 300 * 256)  # 300 tokens a chunk
    keys = torch.full((2, 1000, 1024), 127, dtype=torch.int8)
    keys[1, ::3] = -127
    q = torch.full((2, 3, 1024), 127, dtype=torch.int8)
    want = torch.einsum("rnd,rtd->rnt", q.long(), keys.long())
    assert want.abs().max() == 127 * 127 * 1024
    assert torch.equal(int8_dots.dots(keys, q, "float32").long(), want)


def test_the_float32_form_is_refused_where_fp32_would_round_and_left_out_of_the_choice(monkeypatch):
    keys, q = _codes(1, 8, 1040, seed=0), _codes(1, 1, 1040, seed=1)
    with pytest.raises(ValueError, match="exact up to d=1024; got d=1040"):
        int8_dots.dots(keys, q, "float32")
    timed: list[str] = []
    monkeypatch.setattr(int8_dots, "_chosen", {})
    monkeypatch.setattr(int8_dots, "_elapsed", lambda fn, *a: timed.append(fn.__name__) or 0.0)
    int8_dots.dots(keys, q)
    assert "_float32" not in timed and set(timed) == {"_query_major", "_token_major"}


def test_a_size_gets_the_form_timed_faster_once_and_keeps_it(monkeypatch):
    """The first call of a size times both forms (TIMED_CALLS each) and keeps the faster;
    later calls of that size, up to the next power of two of tokens, time nothing."""
    seconds = {"query_major": 2.0, "token_major": 1.0, "float32": 3.0}
    timed: list[str] = []

    def fake(fn, keys, q):
        name = next(n for n, f in int8_dots._FORM.items() if f is fn)
        timed.append(name)
        return seconds[name]

    monkeypatch.setattr(int8_dots, "_elapsed", fake)
    monkeypatch.setattr(int8_dots, "_chosen", {})
    keys, q = _codes(3, 300, 32, seed=2), _codes(3, 3, 32, seed=3)
    want = int8_dots.dots(keys, q, "query_major")
    got = int8_dots.dots(keys, q)
    assert torch.equal(got, want)
    n = int8_dots.TIMED_CALLS
    assert sorted(timed) == ["float32"] * n + ["query_major"] * n + ["token_major"] * n
    assert int8_dots.chosen_forms() == {(512, 32, 3): "token_major"}
    timed.clear()
    assert torch.equal(int8_dots.dots(keys[:, :260], q), want[:, :, :260])  # 260 -> 512: chosen already
    assert not timed
    seconds.update(query_major=0.5)  # another size is timed on its own
    int8_dots.dots(keys[:, :200], q)
    assert int8_dots.chosen_forms() == {(512, 32, 3): "token_major", (256, 32, 3): "query_major"}


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="allowed: query_major, token_major, float32"):
        int8_dots.dots(_codes(1, 8, 8, seed=0), _codes(1, 1, 8, seed=1), "rows")


def test_the_key_copys_logits_are_the_same_in_either_form(monkeypatch):
    """KeyMirror.logits (int8) gives the same fp32 logits whichever form its size was given."""
    g = torch.Generator().manual_seed(4)
    mirror = KeyMirror("int8", 16)
    mirror.extend(torch.randn(1, 2, 5 * 16, 32, generator=g))
    qg = torch.randn(1, 2, 3, 32, generator=g)
    got = {}
    for form in int8_dots.FORMS:
        monkeypatch.setattr(int8_dots, "_chosen", {})
        monkeypatch.setattr(int8_dots, "_elapsed", lambda fn, *a, f=form: 0.0 if fn is int8_dots._FORM[f] else 1.0)
        got[form] = mirror.logits(qg, 0.125)
        assert set(int8_dots.chosen_forms().values()) == {form}
    assert torch.equal(got["query_major"], got["token_major"])
    assert torch.equal(got["query_major"], got["float32"])
    keys = mirror.k[:, :, :80].float() * mirror.scale[:, :, :80, None]
    ref = torch.einsum("bhnd,bhtd->bhnt", qg, keys) * 0.125
    assert torch.allclose(got["query_major"], ref, rtol=0.02, atol=0.05)
