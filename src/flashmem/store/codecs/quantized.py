"""Shared body of the int8/int4 codecs: keys per channel, values per token."""

from __future__ import annotations

import torch

from flashmem.store.codecs import kivi
from flashmem.store.codecs.base import Codec, Shape, check_pair


class QuantCodec(Codec):
    bits: int

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        check_pair(k, v)
        # payload: K (per-channel groups) | V (per-token groups), uint8 [nbytes]
        return torch.cat([kivi.quantize(k, self.bits, True), kivi.quantize(v, self.bits, False)])

    def decode(
        self, payload: torch.Tensor, shape: Shape, dtype: torch.dtype, *, copy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nk = kivi.nbytes(shape, self.bits, True)
        nv = kivi.nbytes(shape, self.bits, False)
        if payload.numel() != nk + nv:
            raise ValueError(f"{self.name} payload has {payload.numel()} bytes; expected {nk + nv}")
        k = kivi.dequantize(payload[:nk], shape, self.bits, True, dtype)
        v = kivi.dequantize(payload[nk:], shape, self.bits, False, dtype)
        return k, v

    def nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        return kivi.nbytes(shape, self.bits, True) + kivi.nbytes(shape, self.bits, False)
