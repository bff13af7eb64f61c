"""Retrieval through the cache on needle formats and haystacks the retrieval suite does not use.

    python benchmarks/page_retrieval.py 4096 0.0625 full,default,summaries,block passkey,locker_kjv,locker_pydoc 7 0.2,0.5,0.8 [MODEL]

For each format and depth (formats and prompts: `page_recall.probe`) the
full cache of MODEL (default Gemma3-270m) answers, then flashmem with each recipe variant of
`flashmem.memory.budget.VARIANTS` mapped to the budget by
`FlashMemoryConfig.for_budget` (`VARIANT@BUDGET`: at another budget than the run's); greedy, NEW_TOKENS new tokens, right when the first
number in the answer is the needle's (a word, code or date: when the answer
contains it; `page_recall.score`). The formats of `page_recall.LATE_FORMATS`
were added after the recipe was chosen and never used to choose it. One JSON line per prompt: 1/0 per
method, seconds, and the predicted resident fraction. (In the runs of
docs/measurements.md, `default` was the pages recipe with summaries, now
`summaries`, and `nosum` the one without, now `default`.)
"""

from __future__ import annotations

import json
import sys
import time

import torch

from flashmem.config import FlashMemoryConfig
from flashmem.memory.budget import model_geometry, predicted_ratio
from flashmem_eval import harness as H
from page_recall import probe, score

# new tokens per answer: a code like "JQ30-632" after a newline is 9 of Gemma3's tokens
NEW_TOKENS = 12


def main() -> None:
    length, budget = int(sys.argv[1]), float(sys.argv[2])
    methods, fmts, seed = sys.argv[3].split(","), sys.argv[4].split(","), int(sys.argv[5])
    depths = [float(x) for x in sys.argv[6].split(",")]
    torch.set_num_threads(1)
    ld = H.load(sys.argv[7] if len(sys.argv) > 7 else "gemma3-270m")
    tok, model = ld.tokenizer, ld.model
    impl = model.config._attn_implementation
    geo = model_geometry(model)
    for fmt in fmts:
        for depth in depths:
            context, question, answer = probe(tok, fmt, length, depth, seed, salt=str(length))
            ctx = torch.tensor([tok(context, add_special_tokens=True)["input_ids"]])
            q = torch.tensor([tok(question, add_special_tokens=False)["input_ids"]])
            row: dict = {"fmt": fmt, "depth": depth, "tokens": int(ctx.shape[1]), "answer": answer}
            for m in methods:
                t0 = time.time()
                if m == "full":
                    pre = H.prefill_full(model, ctx, obs_window=1)
                    gen, ratio = H.greedy(model, pre.cache, q, NEW_TOKENS, []), 1.0
                else:  # VARIANT or VARIANT@BUDGET (another budget than the run's)
                    name, _, at = m.partition("@")
                    b = float(at) if at else budget
                    cfg = FlashMemoryConfig.for_budget(b, int(ctx.shape[1]), model, variant=name)
                    cache, _, _ = H.prefill_flashmem(model, ctx, cfg)
                    gen = H.greedy(model, cache, q, NEW_TOKENS, [])
                    ratio = round(predicted_ratio(cfg, int(ctx.shape[1]), **geo), 4)
                    H.restore_attn(model, impl)
                    cache.close()
                row[m] = int(score(tok.decode(gen), answer))
                row[f"{m}_out"] = tok.decode(gen)
                row[f"{m}_s"], row[f"{m}_ratio"] = round(time.time() - t0), ratio
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
