"""Where the answer step's attention mass lies on short retrieval prompts, and whether exact token-level
selection of the budget's token count answers: a ranking miss told apart from a budget limit.

    python benchmarks/diagnostics/answer_mass.py mass passkey:kjv:2048:0.3:3 [more prompts]
    python benchmarks/diagnostics/answer_mass.py tokens passkey:kjv:2048:0.3:3 [more prompts] [--budget 0.0625]

Prompts are retrieval-suite probes, `task:haystack:length:depth:seed`
(`flashmem_eval.suites.make_probe`), on Gemma3-270m, one torch thread.

`mass`: a full-cache prefill of context + question; for each global layer, the
question's last query (the one that emits the first answer token), softmax over
every key, averaged over the query heads. Printed: the mass on the recipe's 20
sink tokens, on the last 100 tokens (window, open block, question), on the
middle; of the middle, the best 3 16-token pages (what 1/16 buys at 2K), the
pages holding the answer's digits, and the 16 single tokens with the most mass.

`tokens`: the prompt answered through the cache with the recipe
(`FlashMemoryConfig.for_budget(budget, length)`), then with the same number of
selected tokens chosen one by one by their exact keys (`lsa_page_tokens: 1`,
a model-dtype index: each token's score is its exact q.k; no re-ranking), and
with twice that many. If exact token-level selection of the same count still
misses, no ranking of what the budget holds would answer.
"""

from __future__ import annotations

import argparse

import torch

from flashmem.config import FlashMemoryConfig
from flashmem_eval import harness as H
from flashmem_eval.suites import global_layers, make_probe

SINKS, PAGE, RECENT = 20, 16, 100


def probe_ids(tok, spec: str):
    task, hay, length, depth, seed = spec.split(":")
    p = make_probe(tok, task, int(length), float(depth), int(seed), hay=hay)
    ctx = tok(p.context, add_special_tokens=True)["input_ids"]
    q = tok(p.question, add_special_tokens=False)["input_ids"]
    return p, ctx, q, int(length)


def mass(model, tok, spec: str) -> None:
    p, ctx, q, _ = probe_ids(tok, spec)
    ids = ctx + q
    pieces = [tok.decode([t]) for t in ids]
    digits = [i for i, x in enumerate(pieces) if x.strip().isdigit() and p.answer.startswith(x.strip())]
    pre = H.prefill_full(model, torch.tensor([ids]), obs_window=1)
    print(f"{spec}: answer {p.answer}, {len(ids)} tokens")
    for li in global_layers(model):
        K = pre.cache.layers[li].keys[0, 0].float()  # [T, d] (Gemma3-270m: one KV head)
        Q = pre.captured[li]["query"][0, :, -1].float()  # [Hq, d]
        a = torch.softmax(Q @ K.T * pre.captured[li]["scaling"], -1).mean(0)  # [T]
        T = a.numel()
        mid = a[SINKS : T - RECENT]
        n = mid.numel() // PAGE
        pages = mid[: n * PAGE].view(n, PAGE).sum(-1)
        needle = sorted({(i - SINKS) // PAGE for i in digits if SINKS <= i < SINKS + n * PAGE})
        best3 = float(pages.topk(3).values.sum())
        top = mid.topk(16)
        words = " ".join(repr(pieces[SINKS + int(i)]) for i in top.indices[:6])
        print(
            f"  layer {li:2d}: sinks {a[:SINKS].sum():.3f}  last {RECENT} {a[T - RECENT:].sum():.3f}  "
            f"middle {mid.sum():.3f} = best 3 pages {best3:.3f} (answer's pages {pages[needle].sum():.3f}) "
            f"+ rest {float(mid.sum()) - best3:.3f};  16 best single tokens {top.values.sum():.3f} ({words} ...)"
        )


def tokens(model, tok, spec: str, budget: float) -> None:
    p, ctx, q, length = probe_ids(tok, spec)
    cfg = FlashMemoryConfig.for_budget(budget, length, model)
    n = cfg.lsa_top_k * cfg.page_tokens
    runs = {"recipe": cfg}
    for m in (n, 2 * n):
        runs[f"{m} tokens by exact keys"] = cfg.model_copy(
            update=dict(lsa_page_tokens=1, lsa_top_k=m, lsa_index_dtype="model", lsa_rerank=1, lsa_follow_pages=0)
        )
    for name, c in runs.items():
        cache, _, _ = H.prefill_flashmem(model, torch.tensor([ctx]), c)
        gen = H.greedy(model, cache, torch.tensor([q]), 8, [])
        cache.close()
        print(f"{spec} (answer {p.answer}) {name}: {tok.decode(gen)!r}", flush=True)


def prompt_spec(spec: str) -> str:
    """argparse type: TASK:HAYSTACK:LENGTH:DEPTH:SEED."""
    if spec.count(":") != 4:
        raise argparse.ArgumentTypeError(
            f"{spec!r}: expected TASK:HAYSTACK:LENGTH:DEPTH:SEED, e.g. passkey:kjv:2048:0.3:3"
        )
    return spec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("mass", "tokens"), help="attention mass per layer, or answers by token selection")
    ap.add_argument("specs", nargs="+", type=prompt_spec, metavar="TASK:HAYSTACK:LENGTH:DEPTH:SEED")
    ap.add_argument("--budget", type=float, default=1 / 16, help="resident fraction for `tokens`")
    ap.add_argument("--model", default="gemma3-270m", help="a flashmem.load_model name")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ld = H.load(a.model)
    for spec in a.specs:
        if a.mode == "mass":
            mass(ld.model, ld.tokenizer, spec)
        else:
            tokens(ld.model, ld.tokenizer, spec, a.budget)


if __name__ == "__main__":
    main()
