"""Which pieces of a task prompt flashmem selected while it answered, and whether forcing them in fixes it.

    python benchmarks/diagnostics/task_pieces.py multivalue kjv 4096 0 0.0625 [--wording 0] [--model smollm2]
        [--variant NAME] [--skip-full] [--skip-topk]

One prompt of `flashmem_eval.tasks` (family, haystack, length, seed, wording), fed as the
`tasks` suite feeds it (context through the cache, then the question, greedy), with
`FlashMemoryConfig.for_budget(budget, length, model)` (the recipe). Printed:

- the full cache's and flashmem's answers and scores;
- per piece (a needle sentence the answer needs: the asked key's value, a hop of the chain,
  the passage), its pages and, over the managed layers, at the first single-query step
  (the first generated token fed back): in how many (layer, KV head) pairs its pages were
  selected, and the index rank of its best page (median and worst over heads), with the
  layers where it was ranked out;
- the share of all decode steps x heads x layers where each piece was selected;
- the answer again with every piece's pages forced into each selection (in place of some of the
  recipe's picks; the same number of pages), and with twice the pages (`lsa_top_k`).

A piece whose forced selection answers, while the recipe's does not, is lost by the
selection; one that does not answer even when forced is lost elsewhere (the window,
the int8 working set, the model). One JSON line at the end for the record.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from flashmem.config import FlashMemoryConfig
from flashmem_eval import harness as H
from flashmem_eval.baselines import parse_method
from flashmem_eval.suites import local_cache
from flashmem_eval.tasks import make_task, score_output


def piece_pages(tok: Any, context: str, piece: str, sinks: int, page: int) -> list[int]:
    """Index pages (counted after the sinks) of the tokens of `piece` in `context`."""
    enc = tok(context, add_special_tokens=True, return_offsets_mapping=True)
    a = context.find(piece)
    b = a + len(piece)
    toks = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < b and e > a and e > s]
    return sorted({(t - sinks) // page for t in toks if t >= sinks})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("hay", help="kjv or stdlib-doc")
    ap.add_argument("length", type=int)
    ap.add_argument("seed", type=int)
    ap.add_argument("budget", type=float, help="e.g. 0.0625")
    ap.add_argument("--wording", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--skip-full", action="store_true", help="skip the full cache's answer (known from a run)")
    ap.add_argument("--skip-topk", action="store_true", help="skip the answer with twice the pages (one prefill less)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ld = H.load(a.model)
    tok, model = ld.tokenizer, ld.model
    p = make_task(tok, a.family, a.length, a.seed, hay=a.hay, wording=a.wording)
    ctx = torch.tensor([tok(p.context, add_special_tokens=True)["input_ids"]])
    q = torch.tensor([tok(p.question, add_special_tokens=False)["input_ids"]])
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    cfg = FlashMemoryConfig.for_budget(a.budget, int(ctx.shape[1]), model, variant=a.variant)
    pieces = {pc: piece_pages(tok, p.context, pc, cfg.sink_tokens, cfg.page_tokens) for pc in p.pieces}
    out: dict[str, Any] = {"family": a.family, "hay": a.hay, "length": a.length, "seed": a.seed, "budget": a.budget}
    print(f"items {p.items}; context {ctx.shape[1]} tokens; window {cfg.gpu_cache_limit}, top_k {cfg.lsa_top_k}")

    if not a.skip_full:
        shared: dict[str, Any] = {}
        cache, _, _ = local_cache(ld, parse_method("full"), 1.0, ctx, shared)
        full_text = tok.decode(H.greedy(model, cache, q, p.max_new, stop), skip_special_tokens=True)
        out["full"] = score_output(full_text, p)[0]
        print(f"full     {out['full']:.2f} {full_text!r}")

    def answer(config: FlashMemoryConfig, hook: Any = None, record: list | None = None) -> tuple[float, str]:
        cache, _, _ = H.prefill_flashmem(model, ctx, config)

        def wrapped(layer: int, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if record is not None:
                record.append((layer, idx.clone(), scores.float().clone()))
            return idx if hook is None else hook(idx, scores)

        cache.selection_hook = wrapped
        text = tok.decode(H.greedy(model, cache, q, p.max_new, stop), skip_special_tokens=True)
        cache.close()
        return score_output(text, p)[0], text

    rec: list = []
    out["flashmem"], text = answer(cfg, record=rec)
    print(f"flashmem {out['flashmem']:.2f} {text!r}")
    heads = rec[0][1].shape[1]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    layers = sorted({r[0] for r in rec})
    single = [r for r in rec if r[2].shape[2] == group]  # decode steps: one query position
    first = single[: len(layers)]
    per_piece = []
    for pc, pages in pieces.items():
        held, ranks, lost_layers = 0, [], []
        for layer, idx, scores in first:
            n = scores.shape[-1]
            s = scores[0].mean(1)  # [h, pages]: the index's score, pooled over the group's queries
            for h in range(heads):
                sel = set(idx[0, h].tolist())
                pg = [x for x in pages if x < n]
                if not pg:
                    continue  # still in the window: always attended
                order = s[h].argsort(descending=True).tolist()
                r = min(order.index(x) for x in pg)
                ranks.append(r)
                ok = any(x in sel for x in pg)
                held += ok
                if not ok and layer not in lost_layers:
                    lost_layers.append(layer)
        steps = sum(
            any(x in set(idx[0, h].tolist()) for x in pages) for _, idx, _ in single for h in range(heads)
        ) / max(1, len(single) * heads)
        d = {
            "piece": pc[:60],
            "pages": pages,
            "held_first": f"{held}/{len(first) * heads}",
            "rank_median": statistics.median(ranks) if ranks else None,
            "rank_worst": max(ranks) if ranks else None,
            "lost_layers": lost_layers,
            "held_all_steps": round(steps, 3),
        }
        per_piece.append(d)
        print(json.dumps(d))
    out["pieces"] = per_piece
    force = sorted({x for pg in pieces.values() for x in pg})

    def forced(idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n, k = scores.shape[-1], idx.shape[-1]
        want = torch.tensor([x for x in force if x < n], dtype=idx.dtype)
        rows = []
        for h in range(idx.shape[1]):
            keep = [x for x in idx[0, h].tolist() if x not in set(want.tolist())]
            # the pieces first, then the recipe's picks in its order (idx is sorted by page, so the
            # picks dropped are the last pages, not the lowest ranked: a forced run, not a ranking)
            rows.append(sorted((want.tolist() + keep)[:k]) if len(want) <= k else want.tolist())
        return torch.tensor([rows], dtype=idx.dtype)

    out["forced"], text = answer(cfg, hook=forced)
    print(f"pieces forced in {out['forced']:.2f} {text!r}")
    if not a.skip_topk:
        out["top_k_x2"], text = answer(cfg.model_copy(update={"lsa_top_k": 2 * cfg.lsa_top_k}))
        print(f"top_k x2 {out['top_k_x2']:.2f} {text!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
