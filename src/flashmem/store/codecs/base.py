"""Codec interface of the cold tier: a block's (k, v) <-> one flat uint8 payload.

Block tensors are `[batch, kv_heads, B, head_dim]`. A payload is a 1-D
`torch.uint8` tensor; `decode` works on whatever device the payload is on, so a
GPU can dequantize after copying only the coded bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

Shape = tuple[int, int, int, int]  # (batch, kv_heads, B, head_dim)

# Dtype codes written into disk records (stable across versions).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {c: d for d, c in DTYPE_CODES.items()}


class Codec(ABC):
    name: str
    code: int  # written into disk records

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v: [batch, kv_heads, B, head_dim] (same shape) -> uint8 [nbytes] on k's device."""

    @abstractmethod
    def decode(
        self, payload: torch.Tensor, shape: Shape, dtype: torch.dtype, *, copy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [nbytes] -> (k, v) of `shape` and `dtype` on payload's device.

        copy=False lets a codec return views into `payload` (exact only).
        """

    @abstractmethod
    def nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        """Payload bytes of one block (K and V together)."""


def check_pair(k: torch.Tensor, v: torch.Tensor) -> Shape:
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"cold store block: k {tuple(k.shape)} and v {tuple(v.shape)}; "
            "allowed: equal shapes [batch, kv_heads, B, head_dim]"
        )
    if k.dtype != v.dtype or k.dtype not in DTYPE_CODES:
        raise ValueError(
            f"cold store block: dtypes {k.dtype}/{v.dtype}; allowed: one of " + ", ".join(str(d) for d in DTYPE_CODES)
        )
    return tuple(int(s) for s in k.shape)  # type: ignore[return-value]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Any contiguous tensor -> its bytes as uint8 [nbytes] (a view)."""
    return t.contiguous().reshape(-1).view(torch.uint8)
