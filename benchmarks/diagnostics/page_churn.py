"""New pages a decode step selects, step by step, for the recipe and evaluation variants.

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/page_churn.py [--model smollm2] [--tokens 8192]
        [--budget 0.0625] [--variants default,wincap32] [--steps 24] [--text kjv] [--json-out FILE]

Prefills the same prompt (random tokens with the default seed, or `--text` from a haystack) into
the recipe at `--budget` and each variant (`FlashMemoryConfig.for_budget(variant=...)`), decodes
`--steps` greedy tokens and counts, per step, the (KV head, page) pairs of every managed layer's
working set that the step before did not hold, beside the token it generated. A selection that
alternates between two sets shows as a steady count; one that settles as a falling one
(docs/results.md, "The window cap of 8 in the recipe").
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch


def held_pages(layer: Any) -> set[tuple[int, int]]:
    """The (KV head, page) pairs row 0 of a layer's working set holds (empty before any)."""
    idx = layer.working_set.idx
    if idx is None:
        return set()
    heads = torch.arange(idx.shape[1])[:, None].expand_as(idx[0])
    return set(zip(heads.reshape(-1).tolist(), idx[0].reshape(-1).tolist(), strict=True))


def churn(model: Any, ids: torch.Tensor, budget: float, variant: str, steps: int) -> dict[str, Any]:
    import flashmem

    cfg = flashmem.FlashMemoryConfig.for_budget(budget, ids.shape[1] + steps, model, variant=variant)
    cache = flashmem.attach(model, cfg)
    rows = []
    with torch.no_grad():
        nxt = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        before = [held_pages(layer) for layer in cache.flash_layers]
        for _ in range(steps):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            now = [held_pages(layer) for layer in cache.flash_layers]
            new = sum(len(n - b) for n, b in zip(now, before, strict=True))
            rows.append({"token": int(nxt), "new_pages": new, "held_pages": sum(map(len, now))})
            before = now
    return {"variant": variant, "window": cfg.gpu_cache_limit, "pages": cfg.lsa_top_k, "steps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.0625)
    ap.add_argument("--variants", default="default,wincap32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--text", default=None, help="a haystack (kjv, stdlib-doc) instead of random tokens")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    import flashmem

    torch.set_num_threads(1)
    model, tok = flashmem.load_model(a.model)
    if a.text:
        from flashmem.texts import haystack

        ids = torch.tensor([tok(haystack(tok, a.tokens, seed=0, name=a.text))["input_ids"][: a.tokens]])
    else:
        ids = torch.randint(0, model.config.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    out = {"model": a.model, "tokens": int(ids.shape[1]), "budget": a.budget, "text": a.text or "random tokens"}
    out["runs"] = [churn(model, ids, a.budget, v, a.steps) for v in a.variants.split(",")]
    for r in out["runs"]:
        text = tok.decode([s["token"] for s in r["steps"]])
        print(r["variant"], f"window {r['window']}", [s["new_pages"] for s in r["steps"]], repr(text))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
