"""Record the post-RoPE queries and keys (and the values) that attention layers see, for calibration.

One forward per calibration sequence with `use_cache=False`: each layer's
attention function receives this sequence's whole query and key tensors. A
temporary attention implementation records them for the requested layers and
then runs transformers' SDPA attention unchanged, so the model's outputs (and
so the queries of later layers) are the model's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# Must not contain "flash": transformers routes such names to flash-attention kernels.
NAME = "qk_capture"


class Captured:
    """Per layer: lists of queries [Hq, T, d], keys and values [Hkv, T, d] (float32, CPU), and the scaling."""

    def __init__(self, layers: set[int], keep_values: bool = True) -> None:
        self.layers = layers
        self.keep_values = keep_values
        self.queries: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        self.keys: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        self.values: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        self.scaling: dict[int, float] = {}


_ACTIVE: Captured | None = None


def _capturing_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
):
    cap, idx = _ACTIVE, getattr(module, "layer_idx", None)
    if cap is not None and idx in cap.layers:
        cap.queries[idx].append(query[0].detach().float().cpu())  # [Hq, T, d]
        cap.keys[idx].append(key[0].detach().float().cpu())  # [Hkv, T, d]
        if cap.keep_values:
            cap.values[idx].append(value[0].detach().float().cpu())  # [Hkv, T, d] (the cold tier's bases)
        cap.scaling[idx] = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@contextmanager
def capture_qk(model: Any, layers: set[int], keep_values: bool = True) -> Iterator[Captured]:
    """Within the block, forwards of `model` record queries and keys (and values) of `layers`."""
    global _ACTIVE
    AttentionInterface.register(NAME, _capturing_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _ACTIVE = cap = Captured(layers, keep_values)
    try:
        yield cap
    finally:
        _ACTIVE = None
        model.set_attn_implementation(previous)
