"""The working set's pages coded on the device (`working_set_codec`).

A step's selected pages are the largest resident tier at small budgets (70% of
the recipe's budget). Kept as int8 rows (one fp32 scale per token and KV head,
symmetric) they take 1 + 4/d bytes per element instead of the model's 2 or 4,
so the same resident bytes hold about 1.9x (bf16) or 3.8x (fp32) the pages. A
step decodes them to the model's dtype for its attention: a transient of one
layer's working set at a time, as the chunk's own activations are.
"""

from __future__ import annotations

import torch


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> codes int8 [..., d] and scales fp32 [..., 1]: x ~= codes * scale,
    |x - x^| <= scale / 2 per element."""
    scale = x.detach().abs().amax(-1, keepdim=True).float() / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x.float() / safe).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8 [..., d], scale [..., 1] -> [..., d] in `dtype`."""
    return (codes.float() * scale).to(dtype)
