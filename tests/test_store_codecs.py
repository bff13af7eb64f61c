"""Codec round trips: exact is bit-exact; int8/int4 within half a step per group;
payload bytes equal codec_bytes_per_element * elements."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmem.sizing.tiers import codec_bytes_per_element
from flashmem.store.codecs import get_codec
from flashmem.store.codecs.kivi import GROUP


def _block(shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(shape, generator=g) * scale).to(dtype)
    v = (torch.randn(shape, generator=g) * scale * 3 + 0.5).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exact_is_bit_exact(dtype):
    shape = (2, 3, 128, 64)
    k, v = _block(shape, dtype)
    c = get_codec("exact")
    p = c.encode(k, v)
    assert p.dtype == torch.uint8 and p.numel() == c.nbytes(shape, dtype)
    assert p.numel() == codec_bytes_per_element("exact", dtype.itemsize) * 2 * k.numel()
    k2, v2 = c.decode(p, shape, dtype)
    assert k2.dtype == dtype
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8))


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_bytes_match_tiers(codec, dtype):
    shape = (1, 3, 128, 64)
    k, v = _block(shape, dtype)
    c = get_codec(codec)
    p = c.encode(k, v)
    expected = codec_bytes_per_element(codec, dtype.itemsize) * 2 * k.numel()
    assert p.numel() == expected == c.nbytes(shape, dtype)


def _group_steps(x: torch.Tensor, per_channel: bool, bits: int) -> torch.Tensor:
    """Per-element quantization step (max-min)/levels of the element's group: [b,h,T,d]."""
    g = x.float().transpose(-1, -2) if per_channel else x.float()
    b, h, r, L = g.shape
    gg = g.reshape(b, h, r, L // GROUP, GROUP)
    step = (gg.amax(-1) - gg.amin(-1)) / ((1 << bits) - 1)
    step = step[..., None].expand_as(gg).reshape(b, h, r, L)
    return step.transpose(-1, -2) if per_channel else step


@pytest.mark.parametrize("codec,bits", [("int8", 8), ("int4", 4)])
def test_quantized_error_within_half_step(codec, bits):
    shape = (2, 2, 64, 96)
    k, v = _block(shape, seed=3, scale=2.0)
    # a few channels/tokens with large outliers, as real keys have
    k[..., 5] *= 20
    v[:, :, 7, :] *= 20
    c = get_codec(codec)
    k2, v2 = c.decode(c.encode(k, v), shape, torch.float32)
    for x, y, per_channel in ((k, k2, True), (v, v2, False)):
        step = _group_steps(x, per_channel, bits)
        # half a step, plus fp16 rounding of scale (1 ulp up) and float32 arithmetic
        bound = step * 0.5 * (1 + 2**-9) + x.abs() * 2**-20 + 1e-7
        assert ((x - y).abs() <= bound).all(), (x - y).abs().max()


def test_keys_grouped_per_channel_values_per_token():
    shape = (1, 1, 32, 32)
    # keys: each channel constant over tokens -> exact; values: each token constant over channels -> exact
    k = torch.arange(32.0).repeat(32, 1).reshape(shape)  # k[t, d] = d
    v = torch.arange(32.0)[:, None].repeat(1, 32).reshape(shape)  # v[t, d] = t
    c = get_codec("int4")
    k2, v2 = c.decode(c.encode(k, v), shape, torch.float32)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_constant_groups_are_exact():
    shape = (1, 2, 32, 32)
    k = torch.full(shape, 1.25)
    v = torch.zeros(shape)
    for name in ("int8", "int4"):
        c = get_codec(name)
        k2, v2 = c.decode(c.encode(k, v), shape, torch.float32)
        assert torch.equal(k2, k) and torch.equal(v2, v)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 70),
    d=st.integers(1, 70),
    codec=st.sampled_from(["exact", "int8", "int4"]),
    seed=st.integers(0, 2**16),
)
def test_any_shape_round_trips(b, h, t, d, codec, seed):
    """Block sizes / head dims that are not multiples of 32 are padded, not refused."""
    shape = (b, h, t, d)
    k, v = _block(shape, seed=seed)
    c = get_codec(codec)
    p = c.encode(k, v)
    assert p.numel() == c.nbytes(shape, torch.float32)
    k2, v2 = c.decode(p, shape, torch.float32)
    assert k2.shape == k.shape and v2.shape == v.shape
    tol = 0.0 if codec == "exact" else (1.0 if codec == "int4" else 0.1)
    assert (k2 - k).abs().max() <= tol * k.abs().max() + 1e-6
    assert (v2 - v).abs().max() <= tol * v.abs().max() + 1e-6


def test_unknown_codec_is_one_line():
    with pytest.raises(ValueError, match="allowed: exact, int8, int4"):
        get_codec("int3")


def test_mismatched_pair_is_refused():
    with pytest.raises(ValueError, match="equal shapes"):
        get_codec("int8").encode(torch.zeros(1, 1, 32, 32), torch.zeros(1, 1, 32, 64))


@pytest.mark.parametrize("bits", [8, 4])
def test_numpy_and_torch_quantizers_agree(bits):
    """CPU encodes with numpy, other devices with torch: same bytes."""
    from flashmem.store.codecs import kivi

    x, _ = _block((2, 3, 64, 96), seed=9, scale=5.0)
    for per_channel in (True, False):
        g = kivi._grouped(x, per_channel)
        a = kivi._quantize_np(g.numpy(), bits)
        b = kivi._quantize_torch(g, bits).numpy()
        assert (a == b).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_numpy_and_torch_dequantizers_agree(bits):
    from flashmem.store.codecs import kivi

    x, _ = _block((2, 3, 64, 96), seed=4)
    p = kivi.quantize(x, bits, per_channel=False)
    n = x.numel()
    nq, ng = n * bits // 8, n // kivi.GROUP
    a = kivi._dequantize_np(p.numpy(), nq, ng, bits)
    b = kivi._dequantize_torch(p, nq, ng, bits).numpy()
    assert (a == b).all()
