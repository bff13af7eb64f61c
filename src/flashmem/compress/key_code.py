"""Re-rank codes: a sealed block's keys in 4, 2 or 1 bits, for ranking candidates only.

The re-rank (`lsa_rerank`) scores its candidate pages by their keys. Read exact,
that is half of a page's K/V per candidate, 4x the pages attended: on an
accelerator, the largest read of a decode step at long contexts (issue 27:
1 GiB per step at 128K for Llama-3.1-8B's shape). Ranking needs only the order
of the pages' attention mass, not the keys themselves, so `lsa_rerank_codec`
scores them by a code of the keys kept beside the cold tier:

- int4 / int2: each channel of a block quantized between its min and max over
  the block's tokens (KIVI's per-channel keys: key outliers sit in channels);
- sign: each channel's mean over the block, plus or minus its mean absolute
  deviation (1 bit per element; the L1-best two-level code of a channel).

All three decode as zero + q * scale, with an fp16 zero and scale per channel
and block (`RERANK_CODE_BLOCK_BYTES` in config.py). Codes are packed along the
channel axis, low bits first.

Shapes: keys [..., B, d] -> q uint8 [..., B, d * bits / 8], zero and scale fp16
[..., 1, d].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmem.config import RERANK_CODE_BITS


@dataclass
class KeyCode:
    """One or more blocks' keys coded: q [..., B, d*bits/8] uint8, zero/scale [..., 1, d] fp16."""

    q: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    bits: int

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.zero.nbytes + self.scale.nbytes

    def to(self, device: torch.device | str) -> KeyCode:
        return KeyCode(self.q.to(device), self.zero.to(device), self.scale.to(device), self.bits)


def encode(k: torch.Tensor, codec: str) -> KeyCode:
    """Keys k [..., B, d] (one block's tokens on the -2 axis) -> their code."""
    bits = RERANK_CODE_BITS[codec]
    x = k.detach().float()
    if codec == "sign":
        mu = x.mean(-2, keepdim=True)
        dev = (x - mu).abs_().mean(-2, keepdim=True)
        zero, scale = (mu - dev).half(), (2 * dev).half()
        q = (x > mu).to(torch.uint8)
    else:
        levels = (1 << bits) - 1
        lo, hi = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True)
        zero, scale = lo.half(), ((hi - lo) / levels).half()
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
        q = ((x - zero.float()) * inv).round_().clamp_(0, levels).to(torch.uint8)
    return KeyCode(_pack(q, bits), zero, scale, bits)


def decode(code: KeyCode, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code -> keys [..., B, d] in `dtype` (zero + q * scale)."""
    q = _unpack(code.q, code.bits).float()
    return (q * code.scale.float() + code.zero.float()).to(dtype)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q uint8 [..., d] with values < 2**bits -> [..., d * bits / 8], low bits first."""
    per = 8 // bits
    d = q.shape[-1]
    if d % per:
        raise ValueError(f"head_dim {d} is not a multiple of {per} ({bits}-bit codes)")
    g = q.reshape(*q.shape[:-1], d // per, per)
    out = torch.zeros(g.shape[:-1], dtype=torch.uint8, device=q.device)
    for i in range(per):
        out |= g[..., i] << (i * bits)
    return out


def _unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """_pack's inverse: [..., n] -> [..., n * 8 / bits] uint8."""
    per = 8 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)
    return ((p[..., None] >> shifts) & mask).reshape(*p.shape[:-1], p.shape[-1] * per)
