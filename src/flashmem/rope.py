"""RoPE bookkeeping for fused entries.

Cached keys are already rotated. Pooling keys of different positions would mix
their rotations, so fusion un-rotates each key to its pre-RoPE form, pools, and
re-rotates the pooled key at the (weighted mean) position of the tokens it
stands for. Rotations are exact and invertible, so the model's RoPE scaling
factor (if any) is carried through untouched.
"""

from __future__ import annotations

import torch
from torch import nn


class RopeRotator:
    """Rotates head vectors by arbitrary (fractional) positions, Llama convention."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.detach().float()  # [head_dim // 2]

    def _cos_sin(self, pos: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[..., None] * self.inv_freq.to(pos.device)  # [..., head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(like.dtype), emb.sin().to(like.dtype)

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [..., tokens, head_dim]; pos broadcastable to [..., tokens]."""
        cos, sin = self._cos_sin(pos, x)
        return x * cos + _rotate_half(x) * sin

    def unrotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self._cos_sin(pos, x)
        return x * cos - _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def find_rotator(model: nn.Module, layer_type: str | None, head_dim: int) -> RopeRotator | None:
    """The RoPE frequencies a layer of `model` uses, or None if none can be found.

    Models keep them on a `rotary_emb` module: `inv_freq`, or `<layer_type>_inv_freq`
    where layer types use different RoPE (Gemma3's sliding vs global layers).
    """
    for mod in model.modules():
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        inv = None
        if layer_type is not None:
            inv = getattr(mod, f"{layer_type}_inv_freq", None)
        if inv is None:
            inv = getattr(mod, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and inv.numel() * 2 == head_dim:
            return RopeRotator(inv)
    return None
