"""Quantized KV caches as baselines at equal resident bytes (issue 31).

Method names (every token kept, each quantized; none of them takes a budget: the
bit width fixes the bytes, and rows report the measured `ratio` beside the
nominal budget they were run at):

* ``quanto-int4`` / ``quanto-int2``: transformers' `QuantizedCache` with the
  optimum-quanto backend, as a user gets it (per-token groups of 64, scale and
  zero in the model's dtype, a residual window of 128 tokens in full precision);
* ``hqq-int4`` / ``hqq-int2``: the same cache with the HQQ backend;
* ``kivi-int4`` / ``kivi-int2``: KIVI (Liu et al., 2024): keys per channel and
  values per token, groups of 32 with fp16 scale and zero, with flashmem's cold
  codec arithmetic (`flashmem.store.codecs.kivi`); full groups are quantized
  once and never re-quantized, the last < 128 tokens stay in full precision.

All of them are built from the full-attention prefill (what `QuantizedCache`
does too: the prompt attends itself in full precision, then is quantized).

Resident bytes (`quant_bytes`) are counted from what the cache stores: the
packed codes, the scales and zeros, and the residual window. The dequantized
copy each step attends is a transient (one layer at a time), reported apart as
`dequant_transient_bytes`, not in the ratio (as flashmem's step transients are not).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from flashmem.errors import FlashMemError
from flashmem.store.codecs import kivi

QUANT_METHODS = ("quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2", "kivi-int4", "kivi-int2")
GROUP_SIZE = 64  # transformers' QuantizedCache default
RESIDUAL = 128  # transformers' QuantizedCache default; KIVI's R


def parse_quant(name: str) -> tuple[str, int]:
    """'quanto-int4' -> ('quanto', 4); a one-line error naming the allowed names otherwise."""
    if name not in QUANT_METHODS:
        raise FlashMemError(f"method: {name!r} is not known; allowed quantized caches: {', '.join(QUANT_METHODS)}")
    backend, bits = name.split("-int")
    return backend, int(bits)


# ----------------------------------------------------------------------------- KIVI layer
def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) -> packed bytes (8 // bits codes a byte, low bits first)."""
    per = 8 // bits
    q = q.reshape(-1, per).to(torch.uint8)
    out = torch.zeros(q.shape[0], dtype=torch.uint8)
    for i in range(per):
        out |= q[:, i] << (bits * i)
    return out


def _unpack(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    return torch.stack([(p >> (bits * i)) & mask for i in range(per)], dim=-1).reshape(-1)[:n]


class KiviBlock:
    """One quantized span of tokens of one tensor: packed codes + fp16 scale/zero per group of 32."""

    def __init__(self, x: torch.Tensor, bits: int, per_channel: bool) -> None:
        self.shape = tuple(int(s) for s in x.shape)
        self.bits, self.per_channel, self.dtype = bits, per_channel, x.dtype
        g = kivi._grouped(x, per_channel)  # [b, h, rows, Lp] float32, group axis last
        self.grouped_shape = tuple(g.shape)
        levels = (1 << bits) - 1
        # kivi's arithmetic (fp16 zero rounded down, scale rounded up, so |x - x^| <= scale / 2),
        # at any bit width: the codec module packs only 4 bits
        gg = g.reshape(-1, kivi.GROUP)
        mn, mx = gg.amin(-1), gg.amax(-1)
        zero = mn.to(torch.float16)
        zero = torch.where(zero.float() > mn, -kivi._next_up_f16(-zero), zero)
        want = (mx - zero.float()) / levels
        scale = want.to(torch.float16)
        scale = torch.where(scale.float() < want, kivi._next_up_f16(scale), scale)
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        q = torch.round((gg - zero.float()[:, None]) * inv[:, None]).clamp_(0, levels).to(torch.uint8)
        self.codes = _pack(q.reshape(-1), bits)
        self.scale, self.zero = scale, zero

    def nbytes(self) -> dict[str, int]:
        return {
            "codes": self.codes.numel(),
            "scales": self.scale.numel() * self.scale.element_size() + self.zero.numel() * self.zero.element_size(),
        }

    def dequantize(self) -> torch.Tensor:
        n = self.scale.numel() * kivi.GROUP
        q = _unpack(self.codes, self.bits, n).float().reshape(-1, kivi.GROUP)
        x = (q * self.scale.float()[:, None] + self.zero.float()[:, None]).reshape(self.grouped_shape)
        b, h, t, d = self.shape
        x = x[..., : (t if self.per_channel else d)]
        if self.per_channel:
            x = x.transpose(-1, -2)
        return x.to(self.dtype).contiguous()


class KiviLayer(DynamicLayer):
    """KIVI: full groups of tokens quantized once (keys per channel, values per token);
    the residual (< `residual` tokens) in full precision. `self.keys/values` hold the residual."""

    is_sliding = False

    def __init__(self, bits: int, residual: int = RESIDUAL) -> None:
        super().__init__()
        if residual % kivi.GROUP:
            raise FlashMemError(f"kivi residual: {residual} is not allowed; allowed: a multiple of {kivi.GROUP}")
        self.bits, self.residual = bits, residual
        self.blocks: list[tuple[KiviBlock, KiviBlock]] = []
        self._deq_k: torch.Tensor | None = None  # dequantized blocks, kept so each step dequantizes only new ones
        self._deq_v: torch.Tensor | None = None
        self.cumulative_length = 0

    def _flush(self, upto: int) -> None:
        """Quantize the first `upto` residual tokens (a multiple of the group) into a block."""
        if upto <= 0:
            return
        k, v = self.keys[..., :upto, :], self.values[..., :upto, :]
        bk, bv = KiviBlock(k, self.bits, per_channel=True), KiviBlock(v, self.bits, per_channel=False)
        self.blocks.append((bk, bv))
        dk, dv = bk.dequantize(), bv.dequantize()
        self._deq_k = dk if self._deq_k is None else torch.cat([self._deq_k, dk], dim=-2)
        self._deq_v = dv if self._deq_v is None else torch.cat([self._deq_v, dv], dim=-2)
        self.keys, self.values = self.keys[..., upto:, :], self.values[..., upto:, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        parts_k = [self.keys] if self._deq_k is None else [self._deq_k, self.keys]
        parts_v = [self.values] if self._deq_v is None else [self._deq_v, self.values]
        out_k, out_v = torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)
        n = self.keys.shape[-2]
        if n >= self.residual:  # quantize whole groups; keep the remainder (< a group) exact
            self._flush(n - n % kivi.GROUP)
        return out_k, out_v

    def quantize_prompt(self) -> None:
        """After a prefill: quantize every whole group, keep the remainder exact (KIVI)."""
        n = self.keys.shape[-2]
        self._flush(n - n % kivi.GROUP)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def byte_parts(self) -> dict[str, int]:
        codes = sum(bk.nbytes()["codes"] + bv.nbytes()["codes"] for bk, bv in self.blocks)
        scales = sum(bk.nbytes()["scales"] + bv.nbytes()["scales"] for bk, bv in self.blocks)
        return {"codes": codes, "scales": scales, "residual": _tensor_bytes(self.keys) + _tensor_bytes(self.values)}


# ----------------------------------------------------------------------------- byte accounting
def _tensor_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    return t.numel() * t.element_size()


def _quanto_parts(qt: Any) -> tuple[int, int]:
    """(codes, scale + shift bytes) of an optimum-quanto WeightQBitsTensor (packed uint8 inside)."""
    data = qt._data
    packed = getattr(data, "_data", data)  # PackedTensor wraps the packed uint8
    return _tensor_bytes(packed), _tensor_bytes(qt._scale) + _tensor_bytes(qt._shift)


def _hqq_parts(q: Any) -> tuple[int, int]:
    qtensor, meta = q
    return _tensor_bytes(qtensor), _tensor_bytes(meta["scale"]) + _tensor_bytes(meta["zero"])


def layer_parts(layer: Any) -> dict[str, int]:
    """{'codes', 'scales', 'residual'} bytes one layer stores."""
    if isinstance(layer, KiviLayer):
        return layer.byte_parts()
    codes = scales = 0
    for attr in ("_quantized_keys", "_quantized_values"):
        q = getattr(layer, attr, None)
        if q is None:
            continue
        c, s = _hqq_parts(q) if isinstance(q, tuple) else _quanto_parts(q)
        codes, scales = codes + c, scales + s
    resid = _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))
    return {"codes": codes, "scales": scales, "residual": resid}


def quant_bytes(cache: Any) -> dict[str, int]:
    tot = {"codes": 0, "scales": 0, "residual": 0}
    for layer in cache.layers:
        for k, v in layer_parts(layer).items():
            tot[k] += v
    tot["total"] = tot["codes"] + tot["scales"] + tot["residual"]
    return tot


# ----------------------------------------------------------------------------- the cache
class QuantBaselineCache(Cache):
    """A cache of quantized layers with a `memory_report` the harness reads (like flashmem's)."""

    def __init__(self, layers: list[Any], name: str) -> None:
        super().__init__(layers=layers)
        self.name = name
        self.peak = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kw: Any):
        out = super().update(key_states, value_states, layer_idx, *args, **kw)
        if layer_idx == len(self.layers) - 1:  # once a step, after every layer stored its tokens
            self.peak = max(self.peak, quant_bytes(self)["total"])
        return out

    def memory_report(self) -> dict[str, Any]:
        b = quant_bytes(self)
        self.peak = max(self.peak, b["total"])
        deq = max((_layer_tokens(layer) for layer in self.layers), default=0)
        return {
            "managed_resident_bytes": b["total"],
            "full_layer_bytes": 0,
            "sliding_layer_bytes": 0,
            "device_resident_bytes": b["total"],
            "peak_managed_resident_bytes": self.peak,
            "tiers": {"codes": b["codes"], "scales": b["scales"], "residual": b["residual"]},
            "dequant_transient_bytes": deq,
        }


def _layer_tokens(layer: Any) -> int:
    """Bytes of one layer's dequantized K and V (what a step materialises, one layer at a time)."""
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        return 0
    b, h, _, d = keys.shape
    return 2 * b * h * int(layer.get_seq_length()) * d * keys.element_size()


def new_layer(backend: str, bits: int, residual: int = RESIDUAL, group: int = GROUP_SIZE) -> Any:
    if backend == "kivi":
        return KiviLayer(bits, residual)
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer
    try:
        return cls(nbits=bits, q_group_size=group, residual_length=residual)
    except ImportError as exc:
        pkg = "optimum-quanto" if backend == "quanto" else "hqq"
        raise FlashMemError(f"method {backend}-int{bits}: {pkg} is not installed ({exc})") from None


def quantized_from_prefill(name: str, prefilled: Any, residual: int = RESIDUAL) -> QuantBaselineCache:
    """A quantized cache holding what the full-attention prefill `prefilled` (a DynamicCache) holds.

    The source is left as it is. Models with sliding-window layers are refused, as
    transformers' QuantizedCache refuses them."""
    backend, bits = parse_quant(name)
    layers = []
    for src in prefilled.layers:
        if getattr(src, "is_sliding", False):
            raise FlashMemError(
                f"method {name}: models with sliding-window layers are not supported; allowed: full-attention models"
            )
        layer = new_layer(backend, bits, residual)
        if src.is_initialized and src.keys is not None and src.keys.numel():
            layer.update(src.keys, src.values)  # the first update quantizes the prompt (QuantizedLayer)
            if isinstance(layer, KiviLayer):
                layer.quantize_prompt()
        layers.append(layer)
    return QuantBaselineCache(layers, name)
