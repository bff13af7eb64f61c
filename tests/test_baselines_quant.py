"""Quantized-cache baselines (issue 31): byte accounting by hand, KIVI arithmetic, suites end to end."""

import importlib.util

import pytest
import torch
from transformers import DynamicCache

from flashmem.errors import FlashMemError
from flashmem_eval import harness as H
from flashmem_eval.baselines import parse_method
from flashmem_eval.baselines.quantized import (
    QUANT_METHODS,
    KiviBlock,
    _pack,
    _unpack,
    parse_quant,
    quant_bytes,
    quantized_from_prefill,
)
from flashmem_eval.suites import BenchArgs, run_suite
from flashmem_eval.tiny import tiny_llama, tiny_tokenizer

HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None
HAS_HQQ = importlib.util.find_spec("hqq") is not None
needs_quanto = pytest.mark.skipif(not HAS_QUANTO, reason="optimum-quanto is not installed")

B, HEADS, T, D = 1, 2, 200, 64  # head_dim 64: one quanto/HQQ group per token row, two KIVI value groups
F32 = 4


def _prefilled(layers: int = 2, tokens: int = T, seed: int = 0) -> DynamicCache:
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for i in range(layers):
        k = torch.randn(B, HEADS, tokens, D, generator=g)
        v = torch.randn(B, HEADS, tokens, D, generator=g)
        cache.update(k, v, i)
    return cache


def _elems(tokens: int) -> int:
    return B * HEADS * tokens * D  # of one tensor (K or V) of one layer


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("quanto-int4", marks=needs_quanto),
        pytest.param("quanto-int2", marks=needs_quanto),
        pytest.param("hqq-int4", marks=pytest.mark.skipif(not HAS_HQQ, reason="hqq is not installed")),
        pytest.param("hqq-int2", marks=pytest.mark.skipif(not HAS_HQQ, reason="hqq is not installed")),
    ],
)
def test_quantized_cache_bytes_by_hand(name):
    """transformers' QuantizedCache: bits/8 a code, an fp32 scale and zero per 64 elements, the
    residual window in fp32; the prompt is all quantized, the next tokens wait in the residual."""
    bits = parse_quant(name)[1]
    cache = quantized_from_prefill(name, _prefilled())
    n = _elems(T)
    want_codes = 2 * 2 * n * bits // 8  # 2 layers x (K, V)
    want_scales = 2 * 2 * (n // 64) * 2 * F32  # scale + zero per group of 64
    assert quant_bytes(cache) == {
        "codes": want_codes,
        "scales": want_scales,
        "residual": 0,
        "total": want_codes + want_scales,
    }
    # ratio against the full cache: (bits/8 + 8/64) / 4 bytes an element
    assert quant_bytes(cache)["total"] / (2 * 2 * n * F32) == pytest.approx((bits / 8 + 8 / 64) / 4)
    # ten more tokens: held exact in the residual window, the quantized part unchanged
    for i in range(2):
        cache.update(torch.randn(B, HEADS, 10, D), torch.randn(B, HEADS, 10, D), i)
    got = quant_bytes(cache)
    assert got["residual"] == 2 * 2 * _elems(10) * F32 and got["codes"] == want_codes
    assert cache.get_seq_length() == T + 10


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_bytes_by_hand(bits):
    """KIVI: whole groups of 32 tokens quantized (keys per channel, values per token), fp16
    scale and zero per 32 elements; 200 tokens = 192 quantized + 8 exact."""
    cache = quantized_from_prefill(f"kivi-int{bits}", _prefilled())
    q = _elems(192)
    got = quant_bytes(cache)
    assert got["codes"] == 2 * 2 * q * bits // 8
    assert got["scales"] == 2 * 2 * (q // 32) * 2 * 2
    assert got["residual"] == 2 * 2 * _elems(8) * F32
    # at 128 exact tokens the residual is flushed in whole groups
    for i in range(2):
        cache.update(torch.randn(B, HEADS, 120, D), torch.randn(B, HEADS, 120, D), i)
    got = quant_bytes(cache)
    assert got["residual"] == 0 and got["codes"] == 2 * 2 * _elems(320) * bits // 8
    assert cache.get_seq_length() == 320


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("per_channel", [True, False])
def test_kivi_block_error_within_half_a_step(bits, per_channel):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 64, 64, generator=g) * 3
    blk = KiviBlock(x, bits, per_channel)
    y = blk.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype
    # each group's step is (max - min) / levels; the error is at most half of it (fp16 rounding aside)
    grouped = (x.transpose(-1, -2) if per_channel else x).reshape(-1, 32)
    step = (grouped.amax(-1) - grouped.amin(-1)) / ((1 << bits) - 1)
    err = ((y - x).transpose(-1, -2) if per_channel else (y - x)).reshape(-1, 32).abs().amax(-1)
    assert bool((err <= step / 2 * 1.01 + 1e-3).all())
    assert not torch.equal(y, x)  # it is lossy: a stored copy of x would pass the bound too


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip(bits):
    q = torch.randint(0, 1 << bits, (96,), dtype=torch.uint8)
    p = _pack(q, bits)
    assert p.numel() == 96 * bits // 8 and torch.equal(_unpack(p, bits, 96), q)


def test_unknown_quant_method_is_one_line():
    with pytest.raises(FlashMemError, match="allowed quantized caches: quanto-int4"):
        parse_quant("quanto-int3")
    with pytest.raises(FlashMemError, match="kivi-int2"):
        parse_method("kivi-int3")
    assert parse_method("kivi-int2").kind == "eviction"


def _loaded():
    return H.Loaded("tiny", tiny_llama(layers=2, hidden=128), tiny_tokenizer())


@pytest.mark.parametrize(
    "methods",
    [["full", "kivi-int4", "kivi-int2"], pytest.param(["full", "quanto-int4", "quanto-int2"], marks=needs_quanto)],
)
def test_fidelity_suite_end_to_end(tmp_path, methods):
    """Rows with the measured ratio (codes + scales + residual) beside the nominal budget; int4
    is closer to the full cache than int2, and neither is exact."""
    args = BenchArgs(
        suite="fidelity",
        model="tiny",
        methods=methods,
        budgets=[0.125],
        lengths=[256],
        json_out=tmp_path / "fid.json",
        n_cont=64,
        progress=False,
        threads=1,
    )
    rows = {r["method"]: r for r in run_suite(args, _loaded()).rows.values()}
    assert not any(r.get("error") for r in rows.values())
    int4, int2 = rows[methods[1]], rows[methods[2]]
    for r in (int4, int2):
        assert r["budget"] == 0.125 and 0 < r["ratio"] < 0.5 and r["ratio_end"] > 0
        assert r["kl_mean"] > 0
    assert int2["ratio"] < int4["ratio"] and int2["kl_mean"] > int4["kl_mean"]


def test_retrieval_suite_end_to_end(tmp_path):
    args = BenchArgs(
        suite="retrieval",
        model="tiny",
        methods=["full", "kivi-int2"] + (["quanto-int2"] if HAS_QUANTO else []),
        budgets=[0.125],
        lengths=[300],
        json_out=tmp_path / "ret.json",
        depths=[0.5],
        tasks=["passkey"],
        progress=False,
        threads=1,
    )
    rows = list(run_suite(args, _loaded()).rows.values())
    assert not any(r.get("error") for r in rows)
    q = [r for r in rows if r["method"] != "full"]
    assert q and all(isinstance(r["output"], str) and 0 < r["ratio"] < 0.5 for r in q)


def test_every_method_name_parses():
    for name in QUANT_METHODS:
        assert parse_method(name).variant == name
