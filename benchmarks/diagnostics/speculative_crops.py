"""Speculative decoding through the recipe: greedy, prompt lookup and a self-drafting assistant, with their crops counted.

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/speculative_crops.py greedy,lookup,assist
        [--model smollm2] [--budget 0.0625] [--prompt-tokens 4000] [--new-tokens 64] [--json-out FILE]

Attaches the recipe at `--budget` (sized for 4,096 tokens: at 1/16 an 8-token window) to the
model and generates `--new-tokens` greedy tokens after the default text's first
`--prompt-tokens` tokens, once per mode: `greedy` (one token a forward), `lookup`
(`prompt_lookup_num_tokens=10`) and `assist` (the same model drafting for itself through a
DynamicCache, 20-token drafts: `num_assistant_tokens=20`, constant). Prints, as JSON, each
mode's seconds and tokens (or its error), the crops layer 0 saw, the tokens each unseal gave
back at layer 0 (cache/generation.py), and for each drafting mode the first position where its
tokens leave greedy's. A verify forward selects its pages for all its queries at once, so its
logits are not exactly those of one-token steps, and the tokens can part from greedy's.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import flashmem
from flashmem.cache import generation
from flashmem.texts import load_text

MODES = ("greedy", "lookup", "assist")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modes", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budget", type=float, default=1 / 16)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"mode {bad[0]!r} is not allowed; allowed: {', '.join(MODES)}")
    torch.set_num_threads(1)
    model, tok = flashmem.load_model(a.model)
    ids = tok(load_text("default")[: a.prompt_tokens * 8], return_tensors="pt").input_ids[:, : a.prompt_tokens]
    crops: list[int] = []
    unseals: list[int] = []
    real_crop, real_unseal = generation.crop, generation.unseal

    def spy_crop(layer: Any, n: int, *rest: Any) -> None:
        if layer.layer_idx == 0:
            crops.append(n)
        real_crop(layer, n, *rest)

    def spy_unseal(layer: Any, blocks: generation.Unsealed) -> None:
        if layer.layer_idx == 0:
            unseals.append(sum(bk.shape[-2] for bk, _ in blocks))
        real_unseal(layer, blocks)

    generation.crop, generation.unseal = spy_crop, spy_unseal  # type: ignore[assignment]
    rows: dict[str, Any] = {}
    for mode in modes:
        cache = flashmem.attach(model, budget=a.budget, tokens=4096)
        kw: dict[str, Any] = dict(do_sample=False, max_new_tokens=a.new_tokens, pad_token_id=0)
        if mode == "lookup":
            kw["prompt_lookup_num_tokens"] = 10
        if mode == "assist":  # the model drafts for itself through a DynamicCache: 20-token drafts
            draft, _ = flashmem.load_model(a.model)
            draft.generation_config.num_assistant_tokens = 20
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
            kw["assistant_model"] = draft
        t0 = time.perf_counter()
        try:
            out = model.generate(ids, cache=cache, **kw)
            rows[mode] = {
                "s": round(time.perf_counter() - t0, 1),
                "tokens": out[0, ids.shape[1] :].tolist(),
                "window": cache.flash_layers[0].cfg.gpu_cache_limit,
                "sealed": cache.flash_layers[0].num_sealed,
            }
        except Exception as exc:  # the run's finding, not a crash of this script
            rows[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            cache.close()
    rows["crops_layer0"] = crops
    rows["unsealed_tokens_layer0"] = unseals
    for m in ("lookup", "assist"):
        if "tokens" in rows.get("greedy", {}) and "tokens" in rows.get(m, {}):
            g, t = rows["greedy"]["tokens"], rows[m]["tokens"]
            rows[f"same_tokens_{m}"] = next((i for i, (x, y) in enumerate(zip(g, t)) if x != y), len(g))
    print(json.dumps(rows))
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
