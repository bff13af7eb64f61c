"""The rest entry: one entry per KV head standing for the sealed tokens left out."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache.flash_layer import FlashLayer
from test_cache import ALL_EXACT, SMALL, reference, run
from tiny_models import MODELS, tiny_llama

NO_SUMMARIES = dict(SMALL, use_summaries=False, rest_entry=True, lsa_page_tokens=4)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_rest_entry_is_silent_when_every_page_is_selected(arch):
    model = MODELS[arch]()
    ids = torch.randint(0, 128, (1, 200))
    ref = reference(model, ids, 24)
    cfg = flashmem.FlashMemoryConfig(**{**ALL_EXACT, **NO_SUMMARIES, "lsa_keep_ratio": 1.0})
    out = run(model, flashmem.attach(model, cfg), ids, 24)
    assert (out - ref).abs().max() <= 1e-4


def _layer(cfg: flashmem.FlashMemoryConfig) -> tuple[flashmem.FlashMemoryCache, FlashLayer]:
    cache = flashmem.attach(tiny_llama(), cfg)  # kept by the caller: closing it closes the store
    return cache, cache.flash_layers[0]


def _step(layer: FlashLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    layer.update(k, v)
    layer.take_pending()
    return layer.step(q, k, v, torch.ones(1, k.shape[-2], dtype=torch.bool), 0.5)


@pytest.mark.parametrize("rest", [True, False])
def test_rest_entry_restores_the_mass_of_left_out_tokens(rest):
    """1-token pages with an fp32 index make the rest entry's logit the exact
    log-sum-exp of the left-out tokens' scores; with one value shared by every
    left-out token its value is exact too, so the output equals dense attention.
    Without the entry the same selection renormalises over the kept tokens."""
    torch.manual_seed(0)
    d, n = 16, 64
    cfg = flashmem.FlashMemoryConfig(
        gpu_cache_limit=4,
        sink_tokens=2,
        hca_chunk_size=8,
        csa_chunk_size=1,
        lsa_page_tokens=1,
        lsa_index_dtype="model",
        lsa_top_k=3,
        use_summaries=False,
        rest_entry=rest,
        prefill_chunk=4096,
    )
    cache, layer = _layer(cfg)
    h = 4  # tiny_llama's KV heads
    k = torch.randn(1, h, n, d)
    v = torch.randn(1, h, 1, d).expand(1, h, n, d).clone()
    v[:, :, :2] = torch.randn(1, h, 2, d)  # sinks
    v[:, :, -6:] = torch.randn(1, h, 6, d)  # open block (2) and window (4): attended exactly
    _step(layer, torch.randn(1, h * 2, n, d), k, v)
    assert layer.num_sealed > 0
    q1 = torch.randn(1, h * 2, 1, d)
    k1, v1 = torch.randn(1, h, 1, d), torch.randn(1, h, 1, d)
    out = _step(layer, q1, k1, v1)
    K = torch.cat([k, k1], -2).repeat_interleave(2, dim=1)
    V = torch.cat([v, v1], -2).repeat_interleave(2, dim=1)
    dense = torch.softmax(q1 @ K.transpose(-1, -2) * 0.5, -1) @ V
    err = (out - dense).abs().max()
    assert (err <= 1e-5) if rest else (err > 1e-2)


def test_rest_entry_is_counted_in_the_budget():
    cfg = flashmem.FlashMemoryConfig(**NO_SUMMARIES, lsa_top_k=2)
    model = tiny_llama()
    cache = flashmem.attach(model, cfg)
    run(model, cache, torch.randint(0, 128, (1, 120)), 2)
    layer = cache.flash_layers[0]
    assert layer.resident_bytes()["rest_entry"] == layer.v_sum.nbytes > 0


@pytest.mark.parametrize("coded", [True, False])
def test_rest_value_is_every_sealed_value_less_the_working_set_as_attended(coded):
    """The rest entry's value is taken from the values attention assembles: an int8 working
    set's pages are decoded once, and the value is (v_sum - the valid working-set values'
    sum) / n_left, the padding's values left out. Checked against attention written out."""
    from flashmem.cache.assembly import NEG, Assembly, RestEntry
    from flashmem.compress import page_code

    torch.manual_seed(0)
    b, h, group, d, n = 1, 2, 2, 8, 6
    asm = Assembly(b, h, torch.float32, torch.device("cpu"))
    sk, sv = torch.randn(b, h, 2, d), torch.randn(b, h, 2, d)
    asm.add_valid(sk, sv, torch.ones(b, 2, dtype=torch.bool))
    wk, wv = torch.randn(b, h, n, d), 3 * torch.randn(b, h, n, d)
    valid = torch.tensor([[[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]], dtype=torch.bool)
    bias = torch.zeros(b, h, n).masked_fill(~valid, NEG)
    if coded:
        (kc, ks), (vc, vs) = page_code.encode(wk), page_code.encode(wv)
        asm.mark_working_set((kc, ks), (vc, vs), bias)
        wk, wv = page_code.decode(kc, ks, torch.float32), page_code.decode(vc, vs, torch.float32)
    else:
        asm.mark_working_set(wk, wv, bias)
    v_sum, n_left = 10 * torch.randn(b, h, d), torch.tensor([[7.0, 9.0]])
    q = torch.randn(b, h * group, 1, d)
    logit = torch.randn(b, h * group, 1)
    k_new, v_new = torch.randn(b, h, 1, d), torch.randn(b, h, 1, d)
    rest = RestEntry(logit, v_sum, n_left, valid.float())
    out = asm.attend(q, k_new, v_new, torch.ones(b, 1, dtype=torch.bool), 0.5, rest)

    v_rest = (v_sum - (wv * valid[..., None]).sum(-2)) / n_left[..., None]  # [b, h, d]
    K = torch.cat([sk, wk, k_new], -2).repeat_interleave(group, 1)
    V = torch.cat([sv, wv, v_new, v_rest[:, :, None]], -2).repeat_interleave(group, 1)
    logits = q @ K.transpose(-1, -2) * 0.5
    logits[..., 2 : 2 + n] += bias.repeat_interleave(group, 1)[:, :, None]
    logits = torch.cat([logits, logit[..., None]], -1)  # the rest entry: its logit alone
    ref = torch.softmax(logits, -1) @ V
    assert (out - ref).abs().max() <= 1e-5
