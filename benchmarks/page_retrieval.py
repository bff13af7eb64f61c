"""Retrieval through the cache on needle formats and haystacks the retrieval suite does not use.

    python benchmarks/page_retrieval.py 4096 0.0625 full,default,summaries,block passkey,locker_kjv,locker_pydoc 7 0.2,0.5,0.8 [MODEL]
        [--model MODEL] [--new-tokens 12] [--json-out FILE]

For each format and depth (formats and prompts: `flashmem_eval.benchkit.probe`) the
full cache of MODEL (default Gemma3-270m) answers, then flashmem with each recipe variant of
`flashmem.sizing.budget.VARIANTS` mapped to the budget by
`FlashMemoryConfig.for_budget` (`VARIANT@BUDGET`: at another budget than the run's); greedy, NEW_TOKENS new tokens, right when the first
number in the answer is the needle's (a word, code or date: when the answer
contains it; `flashmem_eval.benchkit.score`). The formats of `benchkit.LATE_FORMATS`
were added after the recipe was chosen and never used to choose it. One JSON line per prompt: 1/0 per
method, seconds, and the predicted resident fraction. (In the runs of
docs/measurements.md, `default` was the pages recipe with summaries, now
`summaries`, and `nosum` the one without, now `default`.)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flashmem.config import FlashMemoryConfig
from flashmem.sizing.budget import model_geometry, predicted_ratio
from flashmem_eval import harness as H
from flashmem_eval.benchkit import LATE_FORMATS, probe, score

# new tokens per answer: a code like "JQ30-632" after a newline is 9 of Gemma3's tokens
NEW_TOKENS = 12


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("length", type=int, help="context tokens of each prompt, e.g. 4096")
    ap.add_argument("budget", type=float, help="resident fraction of the variants without @BUDGET, e.g. 0.0625")
    ap.add_argument("methods", help="comma-separated: full, and for_budget variants as VARIANT or VARIANT@BUDGET")
    ap.add_argument(
        "formats", help=f"comma-separated: passkey, multikey, locker_kjv, locker_pydoc, {', '.join(LATE_FORMATS)}"
    )
    ap.add_argument("seed", type=int, help="prompt seed")
    ap.add_argument("depths", help="comma-separated needle depths, e.g. 0.2,0.5,0.8")
    ap.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model (the form of the older commands)")
    ap.add_argument("--model", default=None, help="a flashmem.load_model name or tiny[:LAYERS] (default gemma3-270m)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="greedy tokens per answer")
    ap.add_argument("--json-out", help="also append each JSON line to this file")
    a = ap.parse_args(argv)
    if a.model and a.model_pos and a.model != a.model_pos:
        ap.error(f"MODEL {a.model_pos!r} and --model {a.model!r} disagree: give one")
    length, budget, seed = a.length, a.budget, a.seed
    methods, fmts = a.methods.split(","), a.formats.split(",")
    depths = [float(x) for x in a.depths.split(",")]
    torch.set_num_threads(1)
    ld = H.load(a.model or a.model_pos or "gemma3-270m")
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
                    gen, ratio = H.greedy(model, pre.cache, q, a.new_tokens, []), 1.0
                else:  # VARIANT or VARIANT@BUDGET (another budget than the run's)
                    name, _, at = m.partition("@")
                    b = float(at) if at else budget
                    cfg = FlashMemoryConfig.for_budget(b, int(ctx.shape[1]), model, variant=name)
                    cache, _, _ = H.prefill_flashmem(model, ctx, cfg)
                    gen = H.greedy(model, cache, q, a.new_tokens, [])
                    ratio = round(predicted_ratio(cfg, int(ctx.shape[1]), **geo), 4)
                    H.restore_attn(model, impl)
                    cache.close()
                row[m] = int(score(tok.decode(gen), answer))
                row[f"{m}_out"] = tok.decode(gen)
                row[f"{m}_s"], row[f"{m}_ratio"] = round(time.time() - t0), ratio
            print(json.dumps(row), flush=True)
            if a.json_out:
                with open(a.json_out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
