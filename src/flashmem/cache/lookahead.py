"""Look ahead (DESIGN.md step 5): which sealed blocks to prefetch for the next step.

Selections drift slowly from one decode step to the next: the blocks chosen
now are the best guess for the next step, and when the choice moves it mostly
moves to a neighbouring block (the text the model is reading continues there).
So the prediction is this step's selected blocks plus their neighbours within
`radius` blocks, where a neighbour counts only if it lies within
`window_tokens` tokens of a selected block (`prefetch_window` in the config;
0 keeps just the selected blocks).

Pure functions: no store, no threads; `FlashLayer.look_ahead` hands the result
to the Prefetcher.
"""

from __future__ import annotations

import torch


def neighbour_radius(block_tokens: int, window_tokens: int, radius: int = 1) -> int:
    """How many blocks on each side of a selected block may be prefetched.

    A neighbour j blocks away starts (j-1)*B tokens after the selected block
    ends, and ends j*B tokens after it: it is within the window when j*B <= window.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens: {block_tokens}; allowed: > 0")
    return max(0, min(int(radius), int(window_tokens) // int(block_tokens)))


def predict_next_blocks(
    idx: torch.Tensor | list[int],
    num_sealed: int,
    block_tokens: int,
    window_tokens: int,
    radius: int = 1,
) -> list[int]:
    """Block ids predicted for the next step, sorted and unique.

    idx: selected block ids of this step, any shape (e.g. [b, h, k]; every
    sequence and KV head's choice counts). num_sealed: blocks that exist (ids
    0..num_sealed-1); ids outside that range are dropped.
    """
    if num_sealed <= 0:
        return []
    if isinstance(idx, torch.Tensor):
        sel = torch.unique(idx.detach().reshape(-1).to("cpu", torch.long))
    else:
        sel = torch.unique(torch.as_tensor(list(idx), dtype=torch.long))
    if sel.numel() == 0:
        return []
    r = neighbour_radius(block_tokens, window_tokens, radius)
    if r > 0:
        offsets = torch.arange(-r, r + 1, dtype=torch.long)
        sel = torch.unique((sel[:, None] + offsets[None, :]).reshape(-1))
    sel = sel[(sel >= 0) & (sel < num_sealed)]
    return sel.tolist()
