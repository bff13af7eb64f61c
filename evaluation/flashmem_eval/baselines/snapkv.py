"""SnapKV baseline (Li et al., 2024): keep the prompt positions the last queries attend to.

After a full-attention prefill, for each global layer and KV head: the queries
of the prompt's last `obs_window` tokens attend (softmax, causal inside the
window) to the earlier prompt keys; the attention is averaged over those queries
and over the query heads of the GQA group, smoothed with a 1-D average pool
(`kernel_size`), and the top positions are kept, plus the observation window
itself. Kept entries = `round(budget * prompt_tokens)` per layer and head.
Later tokens (continuation, question) are appended without further eviction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from flashmem_eval.baselines.evicting import EvictingLayer, to_evicting

DEFAULT_WINDOW = 64
DEFAULT_KERNEL = 5


def snapkv_keep(budget: float, tokens: int) -> int:
    return max(1, min(tokens, round(budget * tokens)))


def snapkv_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float, kernel: int) -> torch.Tensor:
    """Scores [batch, kv_heads, prefix_len] of the prefix keys under the window queries."""
    b, hq, w, d = query.shape
    hk, n = keys.shape[1], keys.shape[2]
    group = hq // hk
    k = keys.repeat_interleave(group, dim=1) if group > 1 else keys
    logits = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling  # b,hq,w,n
    # causal inside the window: query i (position n-w+i) sees keys <= n-w+i
    qpos = torch.arange(n - w, n, device=keys.device).unsqueeze(-1)
    kpos = torch.arange(n, device=keys.device).unsqueeze(0)
    logits = logits.masked_fill(kpos > qpos, float("-inf"))
    attn = logits.softmax(dim=-1)[..., : n - w]  # b,hq,w,prefix
    score = attn.mean(dim=2).view(b, hk, group, n - w).mean(dim=2)
    if kernel > 1 and score.shape[-1] >= kernel:
        score = F.avg_pool1d(score.reshape(b * hk, 1, -1), kernel, stride=1, padding=kernel // 2)
        score = score.reshape(b, hk, -1)[..., : n - w]
    return score


def snapkv_compress(
    cache: DynamicCache,
    captured: dict[int, dict[str, Any]],
    keep: int,
    window: int = DEFAULT_WINDOW,
    kernel: int = DEFAULT_KERNEL,
) -> DynamicCache:
    """A cache keeping `keep` entries per global layer and head; source untouched."""
    out = to_evicting(cache)
    for i, layer in enumerate(out.layers):
        if not isinstance(layer, EvictingLayer):
            continue
        n = layer.stored()
        if n <= keep:
            continue
        w = min(window, keep, n)
        cap = captured.get(i)
        if cap is None:
            raise RuntimeError(f"snapkv: no queries were captured for layer {i}")
        q = cap["query"][:, :, -w:, :]
        scaling = cap["scaling"] if cap["scaling"] is not None else q.shape[-1] ** -0.5
        n_top = keep - w
        b, hk = layer.keys.shape[:2]
        win_idx = torch.arange(n - w, n, device=layer.keys.device).expand(b, hk, w)
        if n_top > 0:
            scores = snapkv_scores(q, layer.keys, float(scaling), kernel)
            top = scores.topk(n_top, dim=-1).indices
            index = torch.cat([top.sort(dim=-1).values, win_idx], dim=-1)
        else:
            index = win_idx
        layer.keep(index)
    return out
