"""Passkey retrieval beyond the training window: full cache vs flashmem real vs window positions.

    python benchmarks/diagnostics/beyond_window.py [--lengths 8192,16384] [--seeds 0] [--depth 0.5]
                                       [--methods window,real,full] [--json results/beyond_window_smollm2.json]

SmolLM2-135M (trained to 8192 positions) on the retrieval suite's passkey prompts
(`flashmem_eval.suites.make_probe`). flashmem: the recipe at `--budget` (default 1/8,
`FlashMemoryConfig.for_budget`, no summaries, which position_mode window requires),
same config for real and window, prompt fed by `flashmem.prefill`; in window mode the
attended positions stay below budget * length + the prompt's tail, inside 8192 up to
a 1/8 budget of 64K. full: DynamicCache, chunked prefill. Greedy, 8 new tokens;
correct = the first number is the key.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import DynamicCache

import flashmem
from flashmem_eval.suites import make_probe, score_answer


def answer(model, tok, ids, method: str, budget: float, variant: str = "default") -> str:
    with torch.no_grad():
        if method == "full":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            for a in range(0, ids.shape[1], 2048):
                out = model(ids[:, a : a + 2048], cache=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits
        else:
            cfg = flashmem.FlashMemoryConfig.for_budget(
                budget, ids.shape[1], model, variant=variant, position_mode=method
            )
            cache = flashmem.attach(model, cfg)
            logits = flashmem.prefill(model, cache, ids, chunk=4096)
        gen = []
        for _ in range(8):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            gen.append(int(nxt))
            logits = model(nxt, cache=cache, use_cache=True).logits
    return tok.decode(gen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--methods", default="window,real,full")
    ap.add_argument("--json", default="results/beyond_window_smollm2.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--variant", default="default", help="a for_budget recipe variant (e.g. even)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = flashmem.load_model("smollm2")
    rows = json.load(open(args.json))["rows"] if os.path.exists(args.json) else []
    for n in map(int, args.lengths.split(",")):
        for seed in map(int, args.seeds.split(",")):
            probe = make_probe(tok, "passkey", n, args.depth, seed)
            ids = tok(probe.context + probe.question, return_tensors="pt").input_ids
            for method in args.methods.split(","):
                t0 = time.perf_counter()
                text = answer(model, tok, ids, method, args.budget, args.variant)
                row = dict(
                    method=method,
                    variant=None if method == "full" else args.variant,
                    budget=1.0 if method == "full" else args.budget,
                    length=n,
                    tokens=int(ids.shape[1]),
                    seed=seed,
                    depth=args.depth,
                    output=text,
                    answer=probe.answer,
                    correct=score_answer(text, probe.answer),
                    seconds=time.perf_counter() - t0,
                    load=os.getloadavg()[0],
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
