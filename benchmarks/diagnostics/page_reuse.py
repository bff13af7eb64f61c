"""How often a decode step's selected pages were selected in recent steps: the hit rate a
device-side page cache of the selection plus `s` more pages per KV head (least recently
selected out first) would have, for several `s`.

The working set is the device's cache of the pages the last step selected (page hit rate in
`traffic_report()`): a page that leaves the selection and comes back crosses the host link
again. Where the budget has room past the selection (the selected-token cap binds from about
12K tokens at 1/8), the room could hold recently dropped pages. This replays the recipe's
selections on a real prompt (a haystack and a question, greedy answer) and counts, per
(layer, KV head), the selected pages an LRU of k + s pages did not hold.

    python benchmarks/diagnostics/page_reuse.py --model gemma3-270m --tokens 4096 --budget 0.0625 --text kjv
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from typing import Any

import torch

import flashmem
from flashmem.texts import haystack


def replay(seq: list[torch.Tensor], extra: int) -> tuple[int, int]:
    """seq: one (layer, KV head)'s sorted selected page ids per decode step -> (hits, misses)
    from the second step on, of an LRU holding the step's selection plus `extra` recently
    dropped pages (the first step fills it)."""
    hits = misses = 0
    cache: OrderedDict[int, None] = OrderedDict()
    for t, ids in enumerate(seq):
        sel = ids.tolist()
        for p in sel:
            if p in cache:
                hits += t > 0
                cache.move_to_end(p)
            else:
                misses += t > 0
                cache[p] = None
        while len(cache) > len(sel) + extra:
            cache.popitem(last=False)
    return hits, misses


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=1 / 16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--text", default="kjv")
    ap.add_argument("--text-seed", type=int, default=0)
    ap.add_argument("--extra", default="0,0.25,0.5,1,2,4", help="extra pages as multiples of the layer's k")
    ap.add_argument("--json", default=None, help="append the row to this JSON-lines file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = flashmem.load_model(args.model)
    body = haystack(tok, args.tokens - 40, seed=args.text_seed, name=args.text)
    prompt = body + "\n\nQuestion: What is the passage above about? Name the people in it.\nAnswer:"
    ids = torch.tensor([tok(prompt, add_special_tokens=True)["input_ids"][: args.tokens]])
    cache = flashmem.attach(model, budget=args.budget, tokens=args.tokens + args.steps, tokenizer=tok)
    logits = flashmem.prefill(model, cache, ids)
    record: dict[int, torch.Tensor] = {}

    def hook(layer_idx: int, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        record[layer_idx] = idx.clone()
        return idx

    cache.selection_hook = hook
    steps: list[list[torch.Tensor]] = []
    nxt = logits[:, -1:].argmax(-1)
    out = []
    with torch.no_grad():
        for _ in range(args.steps):
            record.clear()
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(int(nxt))
            steps.append([row for li in sorted(record) for row in record[li].reshape(-1, record[li].shape[-1])])
    cache.close()
    ks = sorted({int(r.numel()) for step in steps for r in step})
    row: dict[str, Any] = {
        "model": args.model,
        "tokens": args.tokens,
        "budget": args.budget,
        "text": f"{args.text} seed {args.text_seed}",
        "steps": args.steps,
        "pages_per_row": ks,
        "answer": tok.decode(out)[:80],
    }
    rows = [[step[i] for step in steps] for i in range(len(steps[0]))]  # per (layer, KV head)
    for m in map(float, args.extra.split(",")):
        counts = [replay(seq, int(round(m * seq[0].numel()))) for seq in rows]
        hits, misses = sum(c[0] for c in counts), sum(c[1] for c in counts)
        row[f"hit_rate_extra_{m:g}k"] = hits / max(1, hits + misses)
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
