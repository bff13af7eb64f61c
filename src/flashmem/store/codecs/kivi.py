"""KIVI-style asymmetric group quantization shared by the int8 and int4 codecs.

Groups of 32 elements, each with an fp16 scale and an fp16 zero point (the
group minimum): x ~= q * scale + zero, q in [0, 2^bits - 1].
Keys are grouped per channel (32 consecutive tokens of one head_dim channel),
values per token (32 consecutive channels of one token), as in KIVI.

One tensor's payload: q bytes | scale fp16 [groups] | zero fp16 [groups].
A group axis that is not a multiple of 32 is padded by repeating its last
element (the range does not widen); the padding is dropped on decode.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
_FP16_MAX = 65504.0


def padded(n: int) -> int:
    return -(-n // GROUP) * GROUP


def _pad_last(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    p = padded(n) - n
    if p == 0:
        return x
    return torch.cat([x, x[..., -1:].expand(*x.shape[:-1], p)], dim=-1)


def _grouped(x: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """[b, h, T, d] -> [b, h, rows, L] with the group axis last (L padded to 32s)."""
    if per_channel:  # keys: group along tokens
        x = x.transpose(-1, -2)
    return _pad_last(x.float()).contiguous()


def quantize(x: torch.Tensor, bits: int, per_channel: bool) -> torch.Tensor:
    """x: [b, h, T, d] -> uint8 payload (q packed to `bits` | scale | zero), on x's device.

    CPU tensors go through numpy (single-threaded: torch's intra-op pool costs
    ~10x on small blocks when the cores are busy); other devices use torch.
    Both compute the same float32 formulas.
    """
    if x.device.type == "cpu":
        return torch.from_numpy(_quantize_np(_grouped(x, per_channel).numpy(), bits))
    return _quantize_torch(_grouped(x, per_channel), bits)


def _next_up_f16(x: torch.Tensor) -> torch.Tensor:
    """The next fp16 value towards +inf, by bit arithmetic (torch.nextafter lacks
    fp16 kernels on some devices). x: finite fp16."""
    b = x.view(torch.int16)
    up = torch.where(b >= 0, b + 1, b - 1)  # magnitude up for >= +0, down for negatives
    up = torch.where(b == -32768, torch.ones_like(b), up)  # -0 -> smallest positive subnormal
    return up.view(torch.float16)


def _quantize_torch(g: torch.Tensor, bits: int) -> torch.Tensor:
    """g: float32 [..., L] (L % 32 == 0) -> uint8 payload on g's device."""
    levels = (1 << bits) - 1
    lead, L = g.shape[:-1], g.shape[-1]
    g = g.reshape(*lead, L // GROUP, GROUP).clamp(-_FP16_MAX, _FP16_MAX)
    mn, mx = g.amin(-1), g.amax(-1)  # [..., groups]
    # fp16 zero rounded down and fp16 scale rounded up, so every x lies in
    # [zero, zero + levels * scale] and |x - x^| <= scale / 2.
    zero = mn.to(torch.float16)
    zero = torch.where(zero.float() > mn, -_next_up_f16(-zero), zero)
    want = (mx - zero.float()) / levels
    scale = want.to(torch.float16)
    scale = torch.where(scale.float() < want, _next_up_f16(scale), scale)
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    q = torch.round((g - zero.float()[..., None]) * inv[..., None]).clamp_(0, levels).to(torch.uint8)
    q = q.reshape(-1)
    if bits == 4:
        q = q[0::2] | (q[1::2] << 4)  # two values per byte, low nibble first
    return torch.cat([q, scale.reshape(-1).view(torch.uint8), zero.reshape(-1).view(torch.uint8)])


def _quantize_np(g: np.ndarray, bits: int) -> np.ndarray:
    """g: float32 [..., L] (L % 32 == 0) -> uint8 payload; the numpy twin of `quantize`."""
    levels = (1 << bits) - 1
    g = np.clip(g.reshape(*g.shape[:-1], g.shape[-1] // GROUP, GROUP), -_FP16_MAX, _FP16_MAX)
    mn, mx = g.min(-1), g.max(-1)
    zero = mn.astype(np.float16)
    zero = np.where(zero.astype(np.float32) > mn, np.nextafter(zero, np.float16(-np.inf)), zero)
    z = zero.astype(np.float32)
    want = (mx - z) / np.float32(levels)
    scale = want.astype(np.float16)
    scale = np.where(scale.astype(np.float32) < want, np.nextafter(scale, np.float16(np.inf)), scale)
    s = scale.astype(np.float32)
    inv = np.where(s > 0, np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)), np.float32(0.0))
    q = np.clip(np.rint((g - z[..., None]) * inv[..., None]), 0, levels).astype(np.uint8).reshape(-1)
    if bits == 4:
        q = q[0::2] | (q[1::2] << 4)
    return np.concatenate([q, scale.reshape(-1).view(np.uint8), zero.reshape(-1).view(np.uint8)])


def nbytes(shape: tuple[int, int, int, int], bits: int, per_channel: bool) -> int:
    b, h, t, d = shape
    rows, L = (d, t) if per_channel else (t, d)
    n = b * h * rows * padded(L)
    return n * bits // 8 + (n // GROUP) * 4


def dequantize(
    payload: torch.Tensor, shape: tuple[int, int, int, int], bits: int, per_channel: bool, dtype: torch.dtype
) -> torch.Tensor:
    """uint8 payload of one tensor -> [b, h, T, d] in `dtype` on payload's device."""
    b, h, t, d = shape
    rows, L = (d, t) if per_channel else (t, d)
    Lp = padded(L)
    n = b * h * rows * Lp
    nq, ng = n * bits // 8, n // GROUP
    if payload.device.type == "cpu":  # numpy: single-threaded, see `quantize`
        x = torch.from_numpy(_dequantize_np(payload.numpy(), nq, ng, bits))
    else:
        x = _dequantize_torch(payload, nq, ng, bits)
    x = x.reshape(b, h, rows, Lp)[..., :L]  # float32 [groups, 32] -> grouped layout
    if per_channel:
        x = x.transpose(-1, -2)
    return x.to(dtype).contiguous()


def _dequantize_torch(p: torch.Tensor, nq: int, ng: int, bits: int) -> torch.Tensor:
    """uint8 payload -> float32 [groups, 32] on p's device."""
    q = p[:nq]
    scale = p[nq : nq + 2 * ng].view(torch.float16).float()
    zero = p[nq + 2 * ng : nq + 4 * ng].view(torch.float16).float()
    if bits == 4:
        q = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(-1)
    return q.float().reshape(ng, GROUP) * scale[:, None] + zero[:, None]


def _dequantize_np(p: np.ndarray, nq: int, ng: int, bits: int) -> np.ndarray:
    """uint8 payload -> float32 [groups, 32]; the numpy twin of `dequantize`'s arithmetic."""
    q = p[:nq]
    scale = p[nq : nq + 2 * ng].view(np.float16).astype(np.float32)
    zero = p[nq + 2 * ng : nq + 4 * ng].view(np.float16).astype(np.float32)
    if bits == 4:
        q = np.stack([q & 0xF, q >> 4], axis=-1).reshape(-1)
    return q.astype(np.float32).reshape(ng, GROUP) * scale[:, None] + zero[:, None]
