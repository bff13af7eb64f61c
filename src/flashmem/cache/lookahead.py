"""Look ahead (docs/design.md, "Data flow"): which sealed blocks to prefetch for the next step.

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
    max_blocks: int | None = None,
) -> list[int]:
    """Block ids predicted for the next step, unique, most likely first.

    Order: this step's selected blocks (ascending), then their neighbours by
    distance (all at 1 block, then at 2, ...; ascending within a distance).
    max_blocks truncates that list (the prefetch buffer is shared by every
    layer: asking for more than fits would evict blocks before they are used).
    idx: selected block ids of this step, any shape (e.g. [b, h, k]; every
    sequence and KV head's choice counts). num_sealed: blocks that exist (ids
    0..num_sealed-1); ids outside that range are dropped.
    """
    if num_sealed <= 0 or (max_blocks is not None and max_blocks <= 0):
        return []
    if isinstance(idx, torch.Tensor):
        sel = torch.unique(idx.detach().reshape(-1).to("cpu", torch.long))
    else:
        sel = torch.unique(torch.as_tensor(list(idx), dtype=torch.long))
    sel = sel[(sel >= 0) & (sel < num_sealed)]
    out = sel.tolist()
    seen = set(out)
    for dist in range(1, neighbour_radius(block_tokens, window_tokens, radius) + 1):
        if max_blocks is not None and len(out) >= max_blocks:
            break
        near = torch.unique(torch.cat([sel - dist, sel + dist]))
        for j in near[(near >= 0) & (near < num_sealed)].tolist():
            if j not in seen:
                seen.add(j)
                out.append(j)
    return out if max_blocks is None else out[:max_blocks]
