"""exact codec: K and V bytes in the model dtype, K first. nbytes = 2 * numel * itemsize."""

from __future__ import annotations

import math

import torch

from flashmem.store.codecs.base import Codec, Shape, as_bytes, check_pair
from flashmem.store.transfer import cpu_cat_bytes, cpu_copy


class ExactCodec(Codec):
    name = "exact"
    code = 0

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        check_pair(k, v)
        if k.device.type == "cpu" and v.device.type == "cpu":
            return cpu_cat_bytes([k, v])  # uint8 [2 * numel * itemsize]
        return torch.cat([as_bytes(k), as_bytes(v)])

    def decode(
        self, payload: torch.Tensor, shape: Shape, dtype: torch.dtype, *, copy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = math.prod(shape) * dtype.itemsize
        if payload.numel() != 2 * n:
            raise ValueError(f"exact payload has {payload.numel()} bytes; expected {2 * n}")
        k = payload[:n].view(dtype).reshape(shape)
        v = payload[n:].view(dtype).reshape(shape)
        if not copy:
            return k, v
        if payload.device.type == "cpu":
            return cpu_copy(k), cpu_copy(v)
        return k.clone(), v.clone()

    def nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        return 2 * math.prod(shape) * dtype.itemsize
