"""The open block and the window held as one tensor (FlashLayer.append): every token lands in
the tier its position says, whatever the chunking, and a layer whose tiers were set from
outside (a crop, a restored state, a static segment) goes on the same way."""

from __future__ import annotations

import pytest
import torch

import flashmem
from test_cache import SMALL
from tiny_models import tiny_llama

H, D = 2, 16  # tiny_llama: 2 KV heads of 16


def _layer():
    cache = flashmem.attach(tiny_llama(), flashmem.FlashMemoryConfig(**SMALL))
    layer = cache.flash_layers[0]
    first = torch.zeros(1, H, 1, D)
    layer.lazy_initialization(first, first)
    return cache, layer


def _tokens(a: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of positions a..e-1: K's first feature is the position, V's is minus it."""
    k = torch.randn(1, H, e - a, D)
    k[..., 0] = torch.arange(a, e, dtype=torch.float32)
    v = torch.randn(1, H, e - a, D)
    v[..., 0] = -k[..., 0]
    return k, v


def _append(layer, a: int, e: int) -> None:
    k, v = _tokens(a, e)
    layer.append(k, v, torch.ones(1, e - a, dtype=torch.bool), torch.randn(1, H, 2 * (e - a), D), 2)


def _positions(t: torch.Tensor) -> list[int]:
    return t[0, 0, :, 0].round().long().tolist()


def _check(layer, seen: int) -> None:
    S, B, W = SMALL["sink_tokens"], SMALL["hca_chunk_size"], SMALL["gpu_cache_limit"]
    sealed = max(0, seen - S - W) // B
    assert layer.num_sealed == sealed
    assert _positions(layer.sink_k) == list(range(min(S, seen)))
    o0 = S + sealed * B
    w0 = max(o0, seen - W)
    assert _positions(layer.open_k) == list(range(o0, w0))
    if seen > S:
        assert _positions(layer.win_k) == list(range(w0, seen))
    else:
        assert layer.win_k.shape[-2] == 0
    assert _positions(-layer.open_v) == list(range(o0, w0)) and _positions(-layer.win_v) == _positions(layer.win_k)
    for j in range(sealed):  # the cold tier holds each sealed block's exact K/V
        bk, bv = layer.store.get((layer.layer_idx, j))
        assert _positions(bk) == list(range(S + j * B, S + (j + 1) * B)) == _positions(-bv)
    tiers = layer.resident_bytes()  # counted without views: what the views hold
    assert tiers["open_block"] == layer.open_k.nbytes + layer.open_v.nbytes
    assert tiers["window"] == layer.win_k.nbytes + layer.win_v.nbytes
    ks, vs = layer.tail_parts()  # the open block and the window in order, however held
    assert len(ks) == len(vs)
    assert _positions(torch.cat(ks, dim=-2)) == list(range(o0, w0)) + _positions(layer.win_k)


@pytest.mark.parametrize("chunks", [[1] * 90, [5] * 18, [37, 1, 1, 20, 1, 31], [90]])
def test_every_token_lands_in_its_tier(chunks):
    _, layer = _layer()
    seen = 0
    for n in chunks:
        _append(layer, seen, seen + n)
        seen += n
        _check(layer, seen)
    ks, _ = layer.tail_parts()
    assert len(ks) == 1  # appends alone keep the open block and the window in one tensor


def test_tiers_set_from_outside_go_on_the_same_way():
    """Setting the open block or the window (as a crop or a restore does) holds them apart, and
    the next append joins them again: the positions are the same as with appends alone."""
    _, layer = _layer()
    _append(layer, 0, 30)
    layer.open_k = layer.open_k.clone()  # apart now
    assert len(layer.tail_parts()[0]) == 2
    _check(layer, 30)
    # a crop-like change: the window loses its last 3 tokens and is refilled from the open block
    layer.crop(-3)
    _check(layer, 27)
    _append(layer, 27, 64)
    assert len(layer.tail_parts()[0]) == 1
    _check(layer, 64)


def test_views_are_the_same_objects_until_the_tiers_change():
    """StaticStep.serves compares the layer's open block and window by identity."""
    _, layer = _layer()
    _append(layer, 0, 12)
    open_k, win_k = layer.open_k, layer.win_k
    assert layer.open_k is open_k and layer.win_k is win_k
    _append(layer, 12, 13)
    assert layer.win_k is not win_k
