"""Pages per layer: lsa_layer_shares, the layer profile it comes from, and for_budget."""

from __future__ import annotations

import json

import pytest
import torch

import flashmem
from flashmem.calibration import layer_profile as LP
from flashmem.errors import ConfigError
from test_cache import SMALL, run
from test_pages_calibration import _Tok
from tiny_models import tiny_llama

PAGED = dict(SMALL, use_summaries=False, csa_band_tokens=0, lsa_page_tokens=4)


def test_layer_top_k_splits_the_total_by_share():
    cfg = flashmem.FlashMemoryConfig(lsa_top_k=10, lsa_layer_shares={0: 3.0, 2: 0.5})
    k = cfg.layer_top_k([0, 1, 2, 3])  # layers 1 and 3 not named: share 1
    assert sum(k.values()) == 40
    assert k[0] > k[1] == k[3] > k[2]
    assert abs(k[0] - 40 * 3 / 5.5) < 1
    assert flashmem.FlashMemoryConfig(lsa_top_k=10).layer_top_k([0, 1]) == {}


@pytest.mark.parametrize(
    "data, words",
    [
        ({"lsa_top_k": 4, "lsa_layer_shares": {0: -1.0}}, "finite shares >= 0"),
        ({"lsa_top_k": 4, "lsa_layer_shares": {-2: 1.0}}, "layer indices >= 0"),
        ({"lsa_layer_shares": {0: 1.0}}, "set lsa_top_k"),
        ({"lsa_top_k": 4, "lsa_layer_shares": "profil"}, "allowed: profile, null, or a mapping"),
        ({"lsa_top_k": 4, "lsa_layer_shares": [1, 2]}, "allowed: profile, null, or a mapping"),
    ],
)
def test_bad_shares_are_one_line_errors(data, words):
    with pytest.raises(ConfigError, match=words) as exc:
        flashmem.FlashMemoryConfig(**data)
    assert "\n" not in str(exc.value)


def test_shares_for_a_layer_the_model_lacks_are_refused():
    with pytest.raises(ConfigError, match="layer 5 is outside the model's 2 layers"):
        flashmem.attach(tiny_llama(), flashmem.FlashMemoryConfig(**PAGED, lsa_top_k=2, lsa_layer_shares={5: 1.0}))


def test_a_cache_built_without_attach_splits_profile_evenly():
    from flashmem.cache.flash_cache import FlashMemoryCache

    model = tiny_llama()
    cache = FlashMemoryCache(model.config, flashmem.FlashMemoryConfig(**PAGED, lsa_top_k=2, lsa_layer_shares="profile"))
    assert [layer.cfg.lsa_top_k for layer in cache.layers] == [2, 2]


def test_each_layer_attends_its_share_of_pages():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**PAGED, lsa_top_k=3, lsa_layer_shares={0: 5.0, 1: 1.0}))
    run(model, cache, ids, 2)
    # of 6 pages, 5 for layer 0 and 1 for layer 1: the working sets hold 5 x 4 and 1 x 4 tokens
    assert cache.layers[0].ws_k.shape[2] == 20
    assert cache.layers[1].ws_k.shape[2] == 4
    even = flashmem.attach(model, flashmem.FlashMemoryConfig(**PAGED, lsa_top_k=3))
    run(model, even, ids, 2)
    assert even.layers[0].ws_k.shape[2] == even.layers[1].ws_k.shape[2] == 12


def test_far_shares_of_uniform_and_local_attention():
    t, d = 256, 8
    k = torch.randn(1, t, d)
    # zero queries attend uniformly: the far share is the count of far keys over the visible ones
    got = LP.far_shares(torch.zeros(2, t, d), k, 1.0)
    pos = torch.arange(t // 2, t, LP.QUERY_STRIDE).float()
    for w, share in zip(LP.WINDOWS, got):
        want = ((pos - w + 1).clamp_min(0) - LP.SINKS).clamp_min(0) / (pos + 1)
        assert abs(share - float(want.mean())) < 1e-5
    # each query matching only its own key: nothing attended far
    eye = torch.eye(t, d * 32)[:, : d * 32]
    local = LP.far_shares(eye[None] * 50, eye[None], 1.0)
    assert max(local) < 1e-6


def test_layer_shares_follow_the_far_share_with_a_floor():
    prof = {"windows": [16, 64], "far": {"0": [0.9, 0.8], "1": [0.1, 0.0], "2": [0.5, 0.4]}}
    s = LP.layer_shares(prof, window=100)  # beyond the last measured window: read at 64
    assert abs(sum(s.values()) / 3 - 1) < 1e-3
    assert s[0] > s[2] > s[1] > 0
    assert LP.layer_shares(prof, window=16)[1] > s[1]  # at 16 layer 1 attends far too
    mid = LP.layer_shares(prof, window=40)  # halfway: far shares 0.85 / 0.05 / 0.45
    floor = 0.05 * (0.85 + 0.05 + 0.45) / 3
    assert mid[0] / mid[1] == pytest.approx((0.85 + floor) / (0.05 + floor), rel=1e-3)


def test_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMEM_CACHE_DIR", str(tmp_path))
    model = tiny_llama()
    assert LP.cached_layer_profile(model) is None  # nothing cached, no tokenizer
    prof = LP.cached_layer_profile(model, _Tok())
    assert prof is not None and set(prof["far"]) == {"0", "1"}
    assert json.loads(LP.profile_path(model).read_text())["far"] == prof["far"]
    monkeypatch.setattr(LP, "measure_layer_profile", lambda *a, **k: pytest.fail("measured again"))
    assert LP.cached_layer_profile(model, _Tok())["far"] == prof["far"]  # held for this model
    LP._PROFILES.clear()
    assert LP.cached_layer_profile(model, _Tok())["far"] == prof["far"]  # read from the file


def test_the_recipe_splits_pages_by_the_profile_at_attach(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMEM_CACHE_DIR", str(tmp_path))
    model = tiny_llama()
    cfg = flashmem.FlashMemoryConfig.for_budget(1 / 8, 4096, model, prefill_chunk=64)
    assert cfg.lsa_layer_shares == "profile"
    assert flashmem.FlashMemoryConfig.for_budget(1 / 8, 4096, model, variant="even").lsa_layer_shares is None
    with pytest.warns(UserWarning, match="no layer profile cached"):
        even = flashmem.attach(model, cfg)  # nothing cached, no tokenizer: an even split
    assert even.cfg.lsa_layer_shares is None
    assert {layer.cfg.lsa_top_k for layer in even.layers} == {cfg.lsa_top_k}
    split = flashmem.attach(model, cfg, tokenizer=_Tok())
    shares = split.cfg.lsa_layer_shares
    assert isinstance(shares, dict) and set(shares) == {0, 1}
    prof = LP.cached_layer_profile(model)
    assert prof is not None and shares == LP.layer_shares(prof, cfg.gpu_cache_limit + cfg.hca_chunk_size // 2)
    # the same total of pages: the budget does not move
    assert sum(layer.cfg.lsa_top_k for layer in split.layers) == 2 * cfg.lsa_top_k


def test_profile_weight_moves_the_split_toward_even(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMEM_CACHE_DIR", str(tmp_path))
    model = tiny_llama()
    prof = {"format": LP.FORMAT, "windows": [16, 64], "far": {"0": [0.9, 0.8], "1": [0.1, 0.0]}}
    monkeypatch.setattr(LP, "cached_layer_profile", lambda *a, **k: prof)
    base = flashmem.FlashMemoryConfig(**PAGED, lsa_top_k=8, lsa_layer_shares="profile")
    full = LP.resolve_profile_shares(base, model).lsa_layer_shares
    half = LP.resolve_profile_shares(base.model_copy(update={"lsa_layer_profile_weight": 0.5}), model).lsa_layer_shares
    even = LP.resolve_profile_shares(base.model_copy(update={"lsa_layer_profile_weight": 0.0}), model).lsa_layer_shares
    assert full[0] > half[0] > even[0] == 1.0 == even[1]
    assert half[0] == pytest.approx((1 + full[0]) / 2, abs=1e-3)
