"""Where a decode step of the budget recipe spends its time (cProfile), on the tiny model.

    python benchmarks/diagnostics/profile_decode.py [--model tiny|smollm2] [--tokens 32768] [--budget 0.125] [--steps 6] [--prefetch-threads 2]
                                        [--through-prefetcher] [--variant norerank] [--sort tottime]

Prefills the tiny random Llama (`flashmem_eval.benchkit.tiny_llama_long`) through
`FlashMemoryConfig.for_budget(budget, tokens, model)` (memory cold tier),
then profiles `--steps` greedy decode steps after one warm-up and prints ms
per step and the top functions by cumulative time. docs/measurements.md,
"Decode against DynamicCache": the per-page gather and the look-ahead
hand-offs at 1/8 of 32K.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import flashmem
from flashmem_eval.benchkit import tiny_llama_long


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prefetch-threads", type=int, default=2)
    ap.add_argument("--variant", default="default", help="a for_budget variant, e.g. norerank")
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"], help="smollm2: the default text's prompt")
    ap.add_argument("--sort", default="cumulative", choices=["cumulative", "tottime"], help="order of the table")
    ap.add_argument(
        "--through-prefetcher", action="store_true", help="read the memory store through the prefetcher (as before)"
    )
    args = ap.parse_args()
    if args.through_prefetcher:
        from flashmem.cache.flash_layer import FlashLayer

        FlashLayer.read_memory_directly = False
    torch.set_num_threads(1)
    if args.model == "tiny":
        model = tiny_llama_long(args.tokens + args.steps + 8)
        ids = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    else:
        from flashmem.texts import load_text

        model, tokenizer = flashmem.load_model(args.model)
        ids = tokenizer(load_text("default")[: args.tokens * 8], return_tensors="pt").input_ids[:, : args.tokens]
    cfg = flashmem.FlashMemoryConfig.for_budget(
        args.budget, args.tokens, model, variant=args.variant, prefetch_threads=args.prefetch_threads
    )
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        tok = flashmem.prefill(model, cache, ids, chunk=8192)[:, -1].argmax(-1, keepdim=True)
        tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        prof = cProfile.Profile()
        elapsed, held = 0.0, []
        for _ in range(args.steps):
            before = [layer.ws_idx for layer in cache.flash_layers]
            t0 = time.perf_counter()
            prof.enable()
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            prof.disable()
            elapsed += time.perf_counter() - t0
            for layer, prev in zip(cache.flash_layers, before):  # pages kept from the step before
                if prev is not None and layer.ws_idx is not None and prev.shape[:2] == layer.ws_idx.shape[:2]:
                    same = (layer.ws_idx[..., :, None] == prev[..., None, :]).any(-1)
                    held.append(same.float().mean().item())
        print(f"{1e3 * elapsed / args.steps:.1f} ms per decode step")
        if held:
            held.sort()
            print(
                f"selected pages held from the step before, per layer and step: median {held[len(held) // 2]:.0%}, "
                f"min {held[0]:.0%}"
            )
    pstats.Stats(prof).sort_stats(args.sort).print_stats(25)


if __name__ == "__main__":
    main()
