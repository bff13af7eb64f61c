"""Decode ms/token at 32K+ tokens: flashmem vs DynamicCache in one process, steps alternating.

    python benchmarks/decode_alternating.py [--lengths 32768,131072] [--steps 24]
                                            [--json results/decode_alternating_tiny.json]
                                            [--variants norerank] [--no-fixed] [--budget 0.125]
                                            [--model smollm2] [--rebuild] [--ranked]
                                            [--config configs/cpu-small.yaml] [--whole]

`--dtype bfloat16` (SmolLM2): the model, both caches and the recipe's sizing in that dtype.

Model: the tiny random Llama of `flashmem_eval.benchkit.tiny_llama_long` (4 layers, 4 KV heads x 64,
fp32) on random tokens, 1 torch thread; `--model smollm2`: SmolLM2-135M on the
KJV text (trained to 8K, so lengths up to 8192). Per length, three caches live side by
side and decode in turn, the order rotating every step so machine noise hits
them alike (as bench_target_8k.py does on SmolLM2):

- `recipe`: `FlashMemoryConfig.for_budget(budget, n, model)` (budget 1/8 unless `--budget`) (16-token pages,
  int8 mean-key index), memory cold tier; `--config FILE`: that file's config instead
  (a server's fixed config at the lengths of its chats);
- `fixed`: bench_scale.py's config (window 1024, 16 blocks of 128, no summaries),
  memory cold tier: resident size independent of the length;
- `recipe:rebuild` (`--rebuild`): the recipe with its working sets rebuilt every step the
  selection changes, as before 2026-12-03, not written in place (cache/working_set.py);
- `recipe:ranked` (`--ranked`): the recipe with a layer whose pages the budget covers all
  ranked and given a rest entry anyway, as before stop 48 (`tiered_attention.selects_every_page`
  off for its steps);
- `recipe:whole` (`--whole`): the recipe with every decode step's keys and values attended in
  one run whatever their bytes, as before stop 65 (`assembly.DECODE_KV_BYTES` unbounded);
- `dynamic`: DynamicCache filled with random K/V of the length (its O(n^2)
  prefill would take hours here; decode cost does not depend on the values).

flashmem caches are prefilled for real with `flashmem.prefill` (chunks of 8192).
Reported per cache: median and mean decode ms/token, the measured device-resident
fraction (at its peak, which an exact prompt sets, and after decoding), and the ratio DynamicCache / flashmem of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache

import flashmem
from flashmem.cache import assembly, tiered_attention

every_page = tiered_attention.selects_every_page
DECODE_KV_BYTES = assembly.DECODE_KV_BYTES


def never(*_: object) -> bool:
    return False


def tiny(tokens: int):
    from flashmem_eval.benchkit import tiny_llama_long

    return tiny_llama_long(tokens)


def random_dynamic(model, n: int) -> DynamicCache:
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        k, v = torch.randn(1, hkv, n, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen)
        cache.update(k.to(model.dtype), v.to(model.dtype), i)
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default="results/decode_alternating_tiny.json")
    ap.add_argument("--variants", default="", help="more caches: for_budget variants at the budget, e.g. norerank")
    ap.add_argument("--budget", type=float, default=1 / 8, help="resident fraction of the recipe and its variants")
    ap.add_argument("--no-fixed", action="store_true", help="leave out bench_scale's fixed config")
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--rebuild", action="store_true", help="add the recipe with its working sets rebuilt every step")
    ap.add_argument("--ranked", action="store_true", help="add the recipe ranking pages it selects all of")
    ap.add_argument("--whole", action="store_true", help="add the recipe attending a step's K/V in one run")
    ap.add_argument("--config", default=None, help="a YAML config in place of the recipe (variants need the recipe)")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="--model smollm2 loaded in this dtype (the recipe sized for its bytes; DynamicCache holds it too)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.config and args.variants:
        ap.error("--variants are the recipe's; allowed: --config or --variants, not both")
    torch.set_num_threads(1)
    rows = []
    for n in map(int, args.lengths.split(",")):
        if args.model == "tiny":
            model = tiny(n + args.steps + 8)
            ids = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(0))
        else:
            from flashmem.texts import load_text

            model, tok = flashmem.load_model(args.model, dtype=getattr(torch, args.dtype))
            ids = tok(load_text("default")[: n * 8], return_tensors="pt").input_ids[:, :n]
        configs = {
            "recipe": flashmem.FlashMemoryConfig.from_yaml(args.config)
            if args.config
            else flashmem.FlashMemoryConfig.for_budget(args.budget, n, model)
        }
        for v in filter(None, args.variants.split(",")):
            configs[f"recipe:{v}"] = flashmem.FlashMemoryConfig.for_budget(args.budget, n, model, variant=v)
        if args.rebuild:
            configs["recipe:rebuild"] = configs["recipe"]
        if args.ranked:
            configs["recipe:ranked"] = configs["recipe"]
        if args.whole:
            configs["recipe:whole"] = configs["recipe"]
        if not args.no_fixed:
            configs["fixed"] = flashmem.FlashMemoryConfig(gpu_cache_limit=1024, lsa_top_k=16, use_summaries=False)
        caches: dict = {}
        nxt: dict = {}
        prefill_s: dict = {}
        with torch.no_grad():
            for name, cfg in configs.items():
                caches[name] = flashmem.attach(model, cfg)
                t0 = time.perf_counter()
                if name == "recipe:ranked":
                    tiered_attention.selects_every_page = never
                logits = flashmem.prefill(model, caches[name], ids, chunk=8192)
                tiered_attention.selects_every_page = every_page
                prefill_s[name] = time.perf_counter() - t0
                if name == "recipe:rebuild":
                    for layer in caches[name].flash_layers:
                        layer.working_set.in_place = False
                nxt[name] = logits[:, -1].argmax(-1, keepdim=True)
            caches["dynamic"] = random_dynamic(model, n)
            nxt["dynamic"] = ids[:, -1:]
            names = list(caches)
            times: dict = {name: [] for name in names}
            for step in range(args.steps + 1):
                order = names[step % len(names) :] + names[: step % len(names)]
                for name in order:
                    if name == "recipe:ranked":
                        tiered_attention.selects_every_page = never
                    if name == "recipe:whole":
                        assembly.DECODE_KV_BYTES = 1 << 62
                    t0 = time.perf_counter()
                    out = model(nxt[name], cache=caches[name], use_cache=True)
                    dt = time.perf_counter() - t0
                    tiered_attention.selects_every_page = every_page
                    assembly.DECODE_KV_BYTES = DECODE_KV_BYTES
                    nxt[name] = out.logits[:, -1].argmax(-1, keepdim=True)
                    if step:  # the first step of each is a warm-up
                        times[name].append(dt)
        dyn = statistics.median(times["dynamic"])
        for name in names:
            med = statistics.median(times[name])
            row = {
                "tokens": n,
                "cache": name,
                "decode_ms_median": 1e3 * med,
                "decode_ms_mean": 1e3 * statistics.fmean(times[name]),
                "speedup_vs_dynamic": dyn / med,
                "load": os.getloadavg()[0],
                "model": args.model,
                "dtype": args.dtype,
            }
            if name != "dynamic":
                rep = caches[name].memory_report()
                full = sum(layer.keys.nbytes + layer.values.nbytes for layer in caches["dynamic"].layers)
                row["resident_fraction"] = rep["peak_managed_resident_bytes"] / full  # the exact prompt's K/V too
                row["decode_resident_fraction"] = rep["managed_resident_bytes"] / full  # what decoding holds
                row["prefill_s"] = prefill_s[name]
                # bytes a decode step moved, by path, beside what the full cache reads for it
                step = caches[name].traffic_report()["per_decode_step_median"]
                row["traffic_per_decode_step"] = {k: step[k] for k in step}
                if rep["doubt_steps"]:  # exact_on_doubt: steps checked, redone, tokens fed again, ...
                    keys = ("steps", "redone", "redone_tokens", "capped", "changed", "flat")
                    row["doubt"] = {k: rep[f"doubt_{k}"] for k in keys}
                row["config"] = {
                    k: getattr(configs[name], k)
                    for k in (
                        "gpu_cache_limit",
                        "lsa_top_k",
                        "lsa_page_tokens",
                        "lsa_rerank",
                        "working_set_codec",
                        "decode_step",
                        "lsa_fetch_share",
                        "exact_on_doubt",
                        "exact_on_doubt_share",
                        "exact_on_doubt_min_mass",
                    )  # fmt: skip
                }
                caches[name].close()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del caches
    if args.config:
        args.budget = None  # the file's
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
