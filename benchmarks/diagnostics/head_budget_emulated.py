"""Pages split over a layer's KV heads by their attention mass (Ada-KV's allocation): emulated, not built.

The recipe gives every KV head of a layer the same k pages. A head whose attention is
spread (several notes of a list, a count over the text) might use more, and one that
attends a few tokens fewer; Ada-KV (arXiv 2407.11550) splits an eviction budget over heads
that way, and issue 27 welcomes "a budget that adapts per head". Here, with the same
h x k pages a layer, each head takes the pages of most re-rank mass across the layer's
heads (the mass is a share of each head's softmax, so the heads compare), at least
`--floor` x k and at most `--factor` x k each.

The working set holds k pages a head, so a split that is not even needs another layout.
This script emulates it without changing the cache, by patching two functions for the run:

* `CandidateRanker.rerank_in_place` (the re-rank a CPU runs when the candidates are every
  page or most of them) picks `--factor` x k pages a head and marks the ones the split keeps;
* `tiered_attention._select_and_gather` gathers them all, hides the pages not kept from
  attention (their tokens' validity in the working set) and reports only the kept ones as
  selected, so the rest entry counts the others as left out.

So attention sees exactly the split's pages; the working set's bytes are `--factor` x the
recipe's (a real layout would hold the recipe's). Other rankings (index alone, codes) are not
patched. It runs the task suite (`python -m flashmem_eval.task_suite`'s arguments) or the
fidelity suite (`flashmem bench fidelity`'s) with the patch in place:

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/head_budget_emulated.py --factor 2 --floor 0.25 \\
        tasks run FILE --answered-only --model smollm2 --methods full,flashmem --budgets 1/16 ...
    OMP_NUM_THREADS=1 python benchmarks/diagnostics/head_budget_emulated.py --factor 2 --floor 0.25 \\
        fidelity --model smollm2 --methods flashmem --budgets 1/8,1/16 --lengths 4096 --seeds 0,1 ...
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch

STATS: dict[str, list[float]] = {"max_share": [], "min_share": []}  # kept pages of a head / k, per call


def split_pages(mass: torch.Tensor, allowed: torch.Tensor, k: int, factor: float, floor: float, follow: int):
    """mass [b, h, n] -> (idx [b, h, k_max] sorted, keep [b, h, k_max]): each head's k_max =
    min(ceil(factor * k), n) pages of most mass, of which the layer keeps h * k in all: every
    head's ceil(floor * k) best, then the rest by mass across the heads."""
    from flashmem.index.selection import top_pages

    b, h, n = mass.shape
    k_max = min(math.ceil(factor * k), n)
    idx = top_pages(mass, allowed, k_max, follow)  # sorted
    lent = mass
    for j in range(1, min(follow, n - 1) + 1):  # the mass top_pages ranked by (a page lends to its successors)
        shifted = torch.zeros_like(mass)
        shifted[..., j:] = mass[..., :-j] * (1.0 - 1e-3 * j)
        lent = torch.maximum(lent, shifted)
    m = lent.masked_fill(~allowed.expand_as(lent), -1.0).gather(-1, idx)  # [b, h, k_max]
    rank = m.argsort(-1, descending=True).argsort(-1)  # 0: the head's best page
    total = min(h * k, h * k_max)
    boosted = m + (rank < math.ceil(floor * k)).to(m.dtype) * 1e6  # the floor goes first
    thr = boosted.flatten(1).topk(total, dim=-1).values[:, -1:]  # [b, 1]
    keep = boosted >= thr[:, :, None]
    kept = keep.sum(-1).float() / k
    STATS["max_share"].append(float(kept.max()))
    STATS["min_share"].append(float(kept.min()))
    return idx, keep


def patch(factor: float = 2.0, floor: float = 0.25) -> Callable[[], None]:
    """Patch the re-rank and the gather for the run -> a function that undoes it."""
    from flashmem.cache import ranking, tiered_attention
    from flashmem.cache.ranking import CandidateRanker

    real_rerank = CandidateRanker.rerank_in_place
    real_select = tiered_attention._select_and_gather

    def rerank_in_place(self: Any, qg: Any, page_tokens_valid: Any, k_sel: int, *a: Any, **kw: Any) -> Any:
        captured: dict[str, Any] = {}
        real_top = ranking.top_pages

        def top(mass: torch.Tensor, allowed: torch.Tensor, k: int, follow: int = 0) -> torch.Tensor:
            idx, keep = split_pages(mass, allowed, k, factor, floor, follow)
            captured["keep"] = keep
            return idx

        ranking.top_pages = top  # rerank_in_place's own call
        try:
            sel = real_rerank(self, qg, page_tokens_valid, k_sel, *a, **kw)
        finally:
            ranking.top_pages = real_top
        self._head_keep = captured.get("keep") if sel is not None else None
        return sel

    def select_and_gather(layer: Any, *a: Any, **kw: Any) -> torch.Tensor:
        layer.ranker._head_keep = None
        idx = real_select(layer, *a, **kw)
        keep = layer.ranker._head_keep
        if keep is None or keep.shape != idx.shape:
            return idx
        ws = layer.working_set
        page_tokens_valid = a[2]  # (mass, scores, page_tokens_valid, ...)
        b, h, _ = idx.shape
        n_pages, P = page_tokens_valid.shape[1:]
        dense = torch.zeros(b, h, n_pages, dtype=torch.bool, device=idx.device).scatter_(-1, idx, keep)
        bi = torch.arange(b, device=idx.device)[:, None, None]
        held = dense.gather(-1, ws.idx)  # ws.idx: slot order
        ws.valid = page_tokens_valid[bi, ws.idx].reshape(b, h, -1) & held.repeat_interleave(P, dim=-1)
        # reported as selected: the kept pages (a dropped one repeats its head's first kept page)
        first = idx.gather(-1, keep.to(torch.int8).argmax(-1, keepdim=True))
        return torch.where(keep, idx, first)

    CandidateRanker.rerank_in_place = rerank_in_place  # type: ignore[method-assign]
    tiered_attention._select_and_gather = select_and_gather  # type: ignore[assignment]

    def undo() -> None:
        CandidateRanker.rerank_in_place = real_rerank  # type: ignore[method-assign]
        tiered_attention._select_and_gather = real_select

    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factor", type=float, default=2.0, help="a head takes at most this many times k pages")
    ap.add_argument("--floor", type=float, default=0.25, help="and at least this many times k")
    ap.add_argument("suite", choices=["tasks", "fidelity"])
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the suite's own arguments")
    a = ap.parse_args()
    if a.factor < 1 or not 0 < a.floor <= 1:
        ap.error(f"--factor {a.factor} / --floor {a.floor}: allowed: a factor of at least 1, a floor in (0, 1]")
    patch(a.factor, a.floor)
    if a.suite == "tasks":
        import sys

        from flashmem_eval import task_suite

        sys.argv = ["task_suite", *a.args]
        task_suite.main()
    else:
        from flashmem.cli.main import main as cli

        cli(["bench", "fidelity", *a.args])


if __name__ == "__main__":
    main()
