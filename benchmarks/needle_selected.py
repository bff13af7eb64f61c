"""The needle's page at the answer step, through the cache: the share of prompts whose selection holds it, per scorer.

    python benchmarks/needle_selected.py 4096 0.0625 default,norerank,quest,lowrank,learned 0,1,2 \
        [--depths 0.15,0.5,0.85] [--model gemma3-270m] [--json-out F]

The retrieval suite's prompts (`flashmem_eval.suites.make_probe`: passkey and the
locker question, in the KJV text and the stdlib docs), fed as the suite feeds them
(context through the cache, then the question, greedy, 8 tokens), with
`FlashMemoryConfig.for_budget(budget, length, model, variant=...)` for each variant
(`default` is the recipe; `quest`, `lowrank`, `learned` swap the index's scorer,
`norerank` keeps the int8 mean key without the exact re-rank). The lowrank and
learned scorers use the calibration `attach` caches per model (pydoc text, not a
haystack of these prompts).

The answer step is the first step that selects with a single query: the first
generated token's forward when the prompt is attended exactly (the recipe), the
question's last query otherwise. There, per managed layer and KV head, the
selection is checked for a needle page: the 16-token page of the first token of
any occurrence of the answer in the context. Printed per variant: how many prompts
hold a needle page in every managed layer and head, in each layer (the share of
its heads, averaged over prompts), and how many are answered; one JSON line per
prompt and variant with `--json-out`. The same table from such a file (the last row of
each prompt and variant), every length and budget in it:

    python benchmarks/needle_selected.py --summary results/needle_selected_gemma3.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from flashmem.config import FlashMemoryConfig
from flashmem_eval import harness as H
from flashmem_eval.benchkit import needle_pages
from flashmem_eval.suites import make_probe, score_answer

TASKS = ("passkey", "locker")
HAYSTACKS = ("kjv", "stdlib-doc")


def run_prompt(model, tok, probe, budget: float, variant: str) -> dict:
    """One prompt through the cache (configured for its context's tokens, as the suite
    does): the answer, and per managed layer the share of KV heads whose answer-step
    selection holds a needle page."""
    ctx = torch.tensor([tok(probe.context, add_special_tokens=True)["input_ids"]])
    cfg = FlashMemoryConfig.for_budget(budget, int(ctx.shape[1]), model, variant=variant)
    q = torch.tensor([tok(probe.question, add_special_tokens=False)["input_ids"]])
    needle = needle_pages(tok, probe.context, probe.answer, cfg.sink_tokens, cfg.page_tokens)
    group = model.config.get_text_config().num_attention_heads // model.config.get_text_config().num_key_value_heads
    held: dict[int, float] = {}

    def hook(layer: int, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[2] == group and layer not in held:  # a single query: the answer step
            sel = idx[0]  # [h, k]
            held[layer] = float(torch.isin(sel, torch.tensor(needle, device=sel.device)).any(-1).float().mean())
        return idx

    cache, _, _ = H.prefill_flashmem(model, ctx, cfg)
    cache.selection_hook = hook
    gen = H.greedy(model, cache, q, 8, [i for i in [tok.eos_token_id] if i is not None])
    cache.close()
    output = tok.decode(gen, skip_special_tokens=True)
    return {"output": output, "correct": bool(score_answer(output, probe.answer)), "needle_pages": needle, "held": held}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("length", type=int, nargs="?", help="context tokens of each prompt, e.g. 4096")
    ap.add_argument("budget", type=float, nargs="?", help="resident fraction, e.g. 0.0625")
    ap.add_argument("variants", nargs="?", help="comma-separated for_budget variants, e.g. default,norerank")
    ap.add_argument("seeds", nargs="?", help="comma-separated prompt seeds, e.g. 0,1,2")
    ap.add_argument("--depths", default="0.15,0.5,0.85", help="comma-separated needle depths")
    ap.add_argument("--model", default="gemma3-270m", help="a flashmem.load_model name, or tiny[:LAYERS]")
    ap.add_argument("--json-out", help="append one JSON line per prompt and variant to this file")
    ap.add_argument("--summary", metavar="FILE", help="print the table of a --json-out file, run nothing")
    a = ap.parse_args(argv)
    if a.summary:
        with open(a.summary) as f:
            summarize([json.loads(line) for line in f if line.strip()])
        return
    if None in (a.length, a.budget, a.variants, a.seeds):
        ap.error("LENGTH BUDGET VARIANTS SEEDS are required unless --summary FILE is given")
    torch.set_num_threads(1)
    ld = H.load(a.model)
    tok, model = ld.tokenizer, ld.model
    variants = a.variants.split(",")
    probes = [
        (task, hay, float(d), int(s), make_probe(tok, task, a.length, float(d), int(s), hay=hay))
        for s in a.seeds.split(",")
        for task in TASKS
        for hay in HAYSTACKS
        for d in a.depths.split(",")
    ]
    rows = []
    for v in variants:
        for task, hay, depth, seed, p in probes:
            r = run_prompt(model, tok, p, a.budget, v)
            every = bool(r["held"]) and all(s == 1.0 for s in r["held"].values())
            row = {"model": a.model, "length": a.length, "budget": a.budget, "variant": v, "task": task}
            row |= {"haystack": hay, "depth": depth, "seed": seed, "held_every_layer": every, **r}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json_out:
                with open(a.json_out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    summarize(rows)


def summarize(rows: list[dict]) -> None:
    """Per model, length, budget and variant: prompts holding a needle page at the answer
    step in every managed layer and head, prompts answered, and each layer's share held."""
    last = {
        (r["model"], r["length"], r["budget"], r["variant"], r["task"], r["haystack"], r["depth"], r["seed"]): r
        for r in rows
    }
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for key, r in last.items():
        groups[key[:4]].append(r)
    print("prompts whose answer step selects a needle page in every managed layer and head (held),")
    print("prompts answered, and per layer the share of (prompt, KV head) holding one")
    for (model, length, budget, variant), rs in sorted(groups.items()):
        per_layer: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            for layer, share in r["held"].items():
                per_layer[str(layer)].append(share)
        held = sum(r["held_every_layer"] for r in rs)
        answered = sum(r["correct"] for r in rs)
        lay = " ".join(
            f"{k}:{statistics.fmean(x):.2f}" for k, x in sorted(per_layer.items(), key=lambda kv: int(kv[0]))
        )
        print(
            f"  {model} {length:6d} {budget:.4g} {variant:9s} held {held:2d}/{len(rs):2d}  answered {answered:2d}  {lay}"
        )


if __name__ == "__main__":
    main()
