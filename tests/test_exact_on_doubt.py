"""Exact on doubt (`exact_on_doubt`, cache/doubt.py): a decode step whose top two logits are closer
than the threshold is undone and run again with every earlier token attended exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import flashmem
from flashmem.cache import doubt
from flashmem.errors import ConfigError
from test_cache import SMALL, reference, run
from tiny_models import MODELS, tiny_llama

# few pages selected, so a selecting step's logits differ from the full cache's; the prompt exact
SPARSE = dict(SMALL, lsa_top_k=1, prefill_exact_tokens=4096)
STEPS = 40  # with 16-token blocks: several seals among the steps, each then undone and redone
EVERY = dict(exact_on_doubt_share=1.0)  # no cap: every near tie is redone


def _ids(b: int = 1, n: int = 300) -> torch.Tensor:
    return torch.randint(0, 128, (b, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", sorted(MODELS))  # gemma3: sliding layers, restored by reference
def test_every_step_redone_gives_the_full_caches_logits(arch):
    model = MODELS[arch]()
    ids = _ids()
    ref = reference(model, ids, STEPS)
    sparse = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE))
    assert (run(model, sparse, ids, STEPS) - ref)[:, 1:].abs().max() > 1e-2  # selecting steps differ
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, **EVERY, exact_on_doubt=20.0))
    got = run(model, cache, ids, STEPS)
    assert (got - ref).abs().max() <= 1e-4  # every step, the prompt's included
    rep = cache.memory_report()
    assert rep["doubt_steps"] == rep["doubt_redone"] == STEPS
    assert 0 < rep["doubt_changed"] <= STEPS  # random weights: flat logits, so some redos pick another token
    assert rep["sealed_blocks"] == sparse.memory_report()["sealed_blocks"] > 0  # the seals undone and redone
    assert rep["tokens_seen"] == ids.shape[1] + STEPS
    # the exact steps stream the cold tier: the device holds what the selecting steps hold
    assert rep["peak_managed_resident_bytes"] <= 1.05 * sparse.memory_report()["peak_managed_resident_bytes"]


def _steps(model, cache, ids, steps):
    """run()'s token stream, one forward at a time -> [(logits [b, V], redone?)] per step."""
    out = []
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        tok = torch.full((ids.shape[0], 1), 5)
        for _ in range(steps):
            before = cache.doubt.counts["redone"]
            logits = model(tok, cache=cache, use_cache=True).logits[:, -1]
            out.append((logits, cache.doubt.counts["redone"] > before))
            tok = (tok * 7 + 3) % 128
    return out


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_a_step_below_the_threshold_is_redone_with_the_full_caches_logits(arch, monkeypatch):
    """Only steps whose first run's gap is below the threshold are redone; a redone step feeds
    again every token since the last exact point, so its logits are the full cache's, though the
    steps before it selected."""
    model = MODELS[arch]()
    ids = _ids()
    ref = reference(model, ids, STEPS)
    seen: list[float] = []
    chosen: list[int] = []  # the selecting run's next token, each step
    gap = doubt.top_gap

    def spy(logits):
        chosen.append(int(logits[0].argmax()))
        return (g := gap(logits), seen.extend(g.tolist()))[0]

    monkeypatch.setattr(doubt, "top_gap", spy)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, **EVERY, exact_on_doubt=0.1))
    steps = _steps(model, cache, ids, STEPS)
    redone = [s for s, (_, r) in enumerate(steps) if r]
    assert len(seen) == STEPS and [s for s, g in enumerate(seen) if g < 0.1] == redone
    # doubt_changed: the redone steps whose returned (exact) token is not the selecting run's
    changed = sum(int(steps[s][0][0].argmax()) != chosen[s] for s in redone)
    assert cache.memory_report()["doubt_changed"] == changed
    assert 0 < len(redone) < STEPS
    for s, (logits, r) in enumerate(steps):
        err = (logits - ref[:, s + 1]).abs().max()
        assert err <= 1e-4 if r else True, f"step {s}: redone, {err:.2e} from the full cache"
    assert max((logits - ref[:, s + 1]).abs().max() for s, (logits, r) in enumerate(steps) if not r) > 1e-2
    rep = cache.memory_report()
    # each redo fed every token since the previous one (or since the prompt)
    assert rep["doubt_redone_tokens"] == redone[-1] + 1


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_the_share_caps_the_redone_steps_and_the_rest_stay_selected(arch):
    """Every step a near tie, share 1/4: after n checked steps at most FREE_REDOS + n/4 are redone,
    so the first FREE_REDOS steps and then one in four; each redone step (fed again from the last
    exact point, the capped steps included) has the full cache's logits, a capped one does not."""
    model = MODELS[arch]()
    ids = _ids()
    ref = reference(model, ids, STEPS)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, exact_on_doubt=20.0, exact_on_doubt_share=0.25))
    steps = _steps(model, cache, ids, STEPS)
    redone = [s for s, (_, r) in enumerate(steps) if r]
    # worked out by hand: the k-th redo at the n-th checked step needs k <= 8 + n/4, so the
    # steps n = 1-10 (10 <= 10.5), then 12, 16, ..., 40 (0-based: 0-9, 11, 15, ..., 39)
    assert redone == list(range(10)) + list(range(11, STEPS, 4))
    for s, (logits, r) in enumerate(steps):
        err = float((logits - ref[:, s + 1]).abs().max())
        assert err <= 1e-4 if r else err > 1e-3, f"step {s}: redone {r}, {err:.2e} from the full cache"
    rep = cache.memory_report()
    assert rep["doubt_steps"] == STEPS and rep["doubt_redone"] == len(redone)
    assert rep["doubt_capped"] == STEPS - len(redone)
    # a redo feeds the capped steps since the point too: 1 each for the first ten, then 2, then 4s
    assert rep["doubt_redone_tokens"] == 10 + 2 + 4 * 7 == STEPS
    sliding = rep["sliding_layer_bytes"]
    # the last step was redone, so the point is now: a sliding layer holds a copy of its window's
    # oldest REDO_MAX_TOKENS tokens, no more
    assert rep["doubt_held_bytes"] == 0 if not sliding else 0 < rep["doubt_held_bytes"] <= sliding
    with torch.no_grad():
        model(torch.tensor([[5]]), cache=cache, use_cache=True)  # 41st: 19 > 8 + 41/4, capped
    rep = cache.memory_report()
    assert rep["doubt_capped"] == STEPS - len(redone) + 1
    assert rep["doubt_held_bytes"] == 0 if not sliding else 0 < rep["doubt_held_bytes"] <= sliding
    assert rep["device_resident_bytes"] == (
        rep["managed_resident_bytes"] + rep["full_layer_bytes"] + sliding + rep["doubt_held_bytes"]
    )


@pytest.mark.parametrize(("window", "before", "since"), [(10, 30, 1), (10, 30, 4), (10, 6, 3), (100, 5, 4), (3, 30, 4)])
def test_a_sliding_layer_goes_back_to_its_window_at_the_point(monkeypatch, window, before, since):
    """A sliding layer keeps only its window's oldest REDO_MAX_TOKENS tokens at the point (here
    4); after `since` more tokens its window at the point is rebuilt exactly: full windows, one
    not yet full, and one shorter than the tokens since (none of the point's tokens left live)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    monkeypatch.setattr(doubt, "REDO_MAX_TOKENS", 4)
    gen = torch.Generator().manual_seed(window + before + since)
    layer = DynamicSlidingWindowLayer(sliding_window=window)
    for _ in range(before):
        layer.update(torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen))
    want = (layer.keys.clone(), layer.values.clone(), layer.cumulative_length)
    saved = doubt._sliding_point(layer)
    held = sum(t.numel() for t in saved[doubt._HEAD][:2]) * 4
    assert held == 2 * min(4, want[0].shape[-2]) * 2 * 8 * 4  # K and V: at most 4 tokens each
    for _ in range(since):
        layer.update(torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen))
    doubt._restore_sliding(layer, saved, since)
    assert torch.equal(layer.keys, want[0]) and torch.equal(layer.values, want[1])
    assert layer.cumulative_length == want[2]


def test_a_redo_goes_back_at_most_redo_max_tokens(monkeypatch):
    monkeypatch.setattr(doubt, "REDO_MAX_TOKENS", 3)
    model = tiny_llama()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, **EVERY, exact_on_doubt=0.1))
    steps = _steps(model, cache, _ids(), STEPS)
    rep = cache.memory_report()
    assert rep["doubt_redone"] == sum(r for _, r in steps) > 0
    assert rep["doubt_redone"] <= rep["doubt_redone_tokens"] <= 3 * rep["doubt_redone"]
    assert rep["tokens_seen"] == 300 + STEPS


def test_off_by_default_and_for_other_caches():
    model = tiny_llama()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE))
    flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, **EVERY, exact_on_doubt=20.0))  # hooks on the model
    run(model, cache, _ids(), 4)
    assert cache.memory_report()["doubt_steps"] == 0
    model.set_attn_implementation("sdpa")
    dyn = DynamicCache(config=model.config)
    run(model, dyn, _ids(), 4)  # a DynamicCache goes through untouched
    assert dyn.get_seq_length() == 300 + 4


def test_generate_with_padding_answers_as_the_full_cache():
    """generate() over a left-padded batch of two: every step redone, the full cache's tokens."""
    model = tiny_llama()
    ids = _ids(2, 200)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    model.set_attn_implementation("sdpa")
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    want = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, **EVERY, exact_on_doubt=20.0))
    got = model.generate(ids, cache=cache, **kw)
    assert torch.equal(got, want)
    assert cache.memory_report()["doubt_redone"] == 23  # the first token comes from the prompt forward


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (dict(cold_codec="int8"), "exact_on_doubt: 0.5 reads every earlier token back exactly.*cold_codec: int8"),
        (
            dict(position_mode="window", prefill_exact_tokens=0, use_summaries=False),
            "exact_on_doubt's exact steps attend",
        ),
        (dict(exact_on_doubt=-1.0), "exact_on_doubt"),
    ],
)
def test_a_config_it_cannot_serve_is_refused_in_one_line(keys, match):
    base = {**SPARSE, "exact_on_doubt": 0.5, **keys}
    with pytest.raises(ConfigError, match=match) as err:
        flashmem.FlashMemoryConfig(**base)
    assert "\n" not in str(err.value)


def test_a_selecting_forward_of_several_tokens_leaves_no_exact_point():
    """A verify forward after the prompt selects, so the tokens it brings are not fed again by the
    next redo (their K/V stay as they are); the exact prompt is a point, so the first step's redo
    feeds one token."""
    model = tiny_llama()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SPARSE, **EVERY, exact_on_doubt=20.0))
    counts = cache.doubt.counts
    with torch.no_grad():
        model(_ids(), cache=cache, use_cache=True)
        model(torch.tensor([[5]]), cache=cache, use_cache=True)
        assert counts["redone_tokens"] == 1
        model(torch.tensor([[7, 8, 9, 10]]), cache=cache, use_cache=True)  # a verify forward: selects
        assert cache.doubt.ids is None and counts["steps"] == 1
        model(torch.tensor([[11]]), cache=cache, use_cache=True)
        model(torch.tensor([[12]]), cache=cache, use_cache=True)
    assert counts["steps"] == counts["redone"] == 3 and counts["redone_tokens"] == 3
    cache.crop(-1)  # transformers' crop: the tokens since the point are not known any more
    assert cache.doubt.ids is None and cache.get_seq_length() == 300 + 1 + 4 + 1


def test_a_near_tie_in_a_flat_distribution_is_left_as_selected(monkeypatch):
    """exact_on_doubt_min_mass m: a near tie is redone only where its two tokens hold at least m
    of the probability; the others stay as selected and are counted (doubt_flat). Every step of
    the random model is a near tie here; m is the median of its steps' top-two mass."""
    model = tiny_llama()
    ids = _ids()
    ref = reference(model, ids, STEPS)
    base = dict(SPARSE, **EVERY, exact_on_doubt=20.0)
    masses: list[float] = []
    mass = doubt.top_two_mass

    def spy(logits):
        return (m := mass(logits), masses.extend(m.tolist()))[0]

    monkeypatch.setattr(doubt, "top_two_mass", spy)
    _steps(model, flashmem.attach(model, flashmem.FlashMemoryConfig(**base, exact_on_doubt_min_mass=1e-9)), ids, STEPS)
    floor = sorted(masses)[STEPS // 2]
    masses.clear()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**base, exact_on_doubt_min_mass=floor))
    steps = _steps(model, cache, ids, STEPS)
    assert len(masses) == STEPS
    redone = [r for _, r in steps]
    assert redone == [m >= floor for m in masses] and 0 < sum(redone) < STEPS
    for s, (logits, r) in enumerate(steps):
        err = float((logits - ref[:, s + 1]).abs().max())
        assert err <= 1e-4 if r else err > 1e-3, f"step {s}: redone {r}, {err:.2e} from the full cache"
    rep = cache.memory_report()
    assert rep["doubt_flat"] == STEPS - sum(redone) and rep["doubt_redone"] == sum(redone)
