"""flashmem's own SDPA calls (cache/sdpa.py): cuDNN left out on CUDA, where it plans each new
length anew (60 ms a call on an H200); PyTorch's choice elsewhere; the same attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from flashmem.cache import sdpa


def test_cuda_leaves_cudnn_out_and_the_cpu_is_left_alone():
    allowed = sdpa.backends_for(torch.device("cuda", 0))
    assert allowed is not None and SDPBackend.CUDNN_ATTENTION not in allowed and SDPBackend.MATH in allowed
    assert sdpa.backends_for(torch.device("cpu")) is None


def test_the_attention_is_sdpas():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 4, 3, 5).masked_fill_(torch.rand(1, 4, 3, 5, generator=g) > 0.7, float("-inf"))
    mask[..., 0] = 0.0
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.equal(sdpa.attention(q, k, v, mask, 0.3, True), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool per head", "additive"])
@pytest.mark.parametrize("heads", [(6, 2), (3, 3)])
def test_a_half_decode_call_on_the_cpu_is_fp32_attention(dtype, mask_kind, heads, monkeypatch):
    """One query per head in bf16/fp16 on a CPU without AMX for it (where that SDPA is 6-8x slower
    than fp32) is computed in fp32 and cast back: fp64 attention rounded once to the dtype, GQA
    heads paired as enable_gqa pairs them, bool and additive masks alike."""
    monkeypatch.setattr(sdpa, "half_sdpa_is_slow", lambda dt: True)
    hq, hkv = heads
    g = torch.Generator().manual_seed(hq + len(mask_kind))
    b, L, d = 2, 23, 16
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for h, n in ((hq, 1), (hkv, L), (hkv, L)))
    keep = torch.rand(b, hq if mask_kind == "bool per head" else 1, 1, L, generator=g) > 0.4
    keep[..., 0] = True
    mask = {
        "none": None,
        "bool": keep,
        "bool per head": keep,
        "additive": torch.zeros(keep.shape).masked_fill_(~keep, float("-inf")).to(dtype),
    }[mask_kind]
    got = sdpa.attention(q, k, v, mask, 0.3, hq > hkv)
    m64 = None if mask is None else (keep if mask_kind != "additive" else mask.double())
    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=m64, scale=0.3, enable_gqa=hq > hkv
    )
    assert got.dtype == dtype and got.shape == (b, hq, 1, d)
    assert (
        torch.equal(got, want.to(torch.float32).to(dtype))
        or (got.double() - want).abs().max() <= 2 * torch.finfo(dtype).eps * want.abs().max()
    )
    # a query head paired with the wrong KV head (or a mask ignored) is far off
    if hq > hkv:
        wrong = F.scaled_dot_product_attention(
            q.double(), k.double().flip(1), v.double().flip(1), attn_mask=m64, scale=0.3, enable_gqa=True
        )
        assert (got.double() - wrong).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_with_amx_for_the_dtype_the_half_call_is_pytorchs(dtype, monkeypatch):
    """Where the CPU has AMX for the dtype, PyTorch's half SDPA is the faster and is called as is."""
    monkeypatch.setattr(sdpa, "half_sdpa_is_slow", lambda dt: False)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, n, 16, generator=g).to(dtype) for h, n in ((6, 1), (2, 40), (2, 40)))
    keep = torch.rand(1, 1, 1, 40, generator=g) > 0.3
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3, enable_gqa=True)
    assert torch.equal(sdpa.attention(q, k, v, keep, 0.3, True), want)


def test_the_amx_probe_decides_and_a_failing_probe_is_the_slow_path(monkeypatch):
    sdpa.half_sdpa_is_slow.cache_clear()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False, raising=False)
    assert not sdpa.half_sdpa_is_slow(torch.bfloat16) and sdpa.half_sdpa_is_slow(torch.float16)
    sdpa.half_sdpa_is_slow.cache_clear()

    def broken() -> bool:
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", broken, raising=False)
    assert sdpa.half_sdpa_is_slow(torch.bfloat16)
    sdpa.half_sdpa_is_slow.cache_clear()


@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool per head", "additive per head"])
@pytest.mark.parametrize("rows,length", [(1, 600), (3, 200)])
def test_an_fp32_gqa_decode_call_groups_the_query_heads(mask_kind, rows, length, monkeypatch):
    """One fp32 query per head with GQA on a CPU, from GROUPED_MIN_KEYS keys over the rows: each
    KV head's query heads are its queries (one read of it, not one per query head), the same
    attention as enable_gqa's, heads paired as it pairs them; below, PyTorch's call as it is."""
    calls = []
    grouped = sdpa._one_query_grouped
    monkeypatch.setattr(sdpa, "_one_query_grouped", lambda *a: calls.append(1) or grouped(*a))
    g = torch.Generator().manual_seed(rows + len(mask_kind))
    hq, hkv, d = 6, 2, 16
    q, k, v = (torch.randn(rows, h, n, d, generator=g) for h, n in ((hq, 1), (hkv, length), (hkv, length)))
    keep = torch.rand(rows, 1 if mask_kind == "bool" else hq, 1, length, generator=g) > 0.4
    keep[..., 0] = True
    mask = {
        "none": None,
        "bool": keep,
        "bool per head": keep,
        "additive per head": torch.zeros(keep.shape).masked_fill_(~keep, float("-inf")),
    }[mask_kind]
    got = sdpa.attention(q, k, v, mask, 0.3, True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert calls and got.shape == (rows, hq, 1, d)
    assert (got - want).abs().max() <= 1e-5
    # a query head paired with the wrong KV head (or a mask ignored) is far off
    wrong = F.scaled_dot_product_attention(q, k.flip(1), v.flip(1), attn_mask=mask, scale=0.3, enable_gqa=True)
    assert (got - wrong).abs().max() > 0.05
    calls.clear()
    short = k[:, :, : sdpa.GROUPED_MIN_KEYS // rows - 1]
    sdpa.attention(q, short, short, None, 0.3, True)
    assert not calls
