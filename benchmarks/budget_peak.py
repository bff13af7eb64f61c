"""The device peak through a whole request, prompt included, against the budget.

For each context length: the recipe at a budget (`flashmem.attach(model, budget=B, tokens=L)`),
the prompt through `flashmem.prefill` in 8K-token forwards, then decode steps. Printed per
row: the most the cache's managed layers held at any step (`peak_managed_resident_bytes`, plus
full layers) over the budget's bytes (budget x the full cache of those layers at the final
length; a model's own sliding layers are reported apart), the
same with the exact prompt held on the device (a lossy `cold_codec: int8` keeps the old
buffer) for comparison, the step's transients (attention's reused buffers and the streamed
prompt's largest run, `scratch_bytes` / `prompt_stream_bytes`), and the cold-tier bytes the
prompt read back (`traffic_report()`), next to what a full cache holds.

    python benchmarks/budget_peak.py --model tiny --lengths 8192,32768 --budget 0.125
    python benchmarks/budget_peak.py --model smollm2 --lengths 4096,8192 --budget 0.0625
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import flashmem
from flashmem.sizing.budget import full_kv_bytes


def _model(name: str, tokens: int) -> tuple[Any, Any]:
    if name == "tiny":
        from flashmem_eval.benchkit import tiny_llama_long

        return tiny_llama_long(tokens), None
    return flashmem.load_model(name)


def measure(name: str, tokens: int, budget: float, steps: int, codec: str) -> dict[str, Any]:
    model, tok = _model(name, tokens)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = flashmem.attach(model, budget=budget, tokens=tokens + steps, tokenizer=tok, cold_codec=codec)
    t0 = time.perf_counter()
    logits = flashmem.prefill(model, cache, ids)
    prefill_s = time.perf_counter() - t0
    nxt = logits[:, -1:].argmax(-1)
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    mem, traffic = cache.memory_report(), cache.traffic_report()
    full = mem["full_cache_bytes"]
    # the budget is over the managed layers (docs/design.md, "Budget"); a model's own sliding
    # layers (Gemma3's) hold their window whatever the cache does, reported apart
    managed_full = full_kv_bytes(model, mem["tokens_seen"], model.dtype.itemsize)["managed_bytes"]
    peak = mem["peak_managed_resident_bytes"] + mem["full_layer_bytes"]
    row = {
        "model": name,
        "tokens": tokens,
        "budget": budget,
        "cold_codec": codec,
        "full_cache_bytes": full,
        "peak_over_budget": peak / (budget * managed_full),
        "decode_resident_over_budget": (mem["managed_resident_bytes"] + mem["full_layer_bytes"])
        / (budget * managed_full),
        "sliding_layer_bytes": mem["sliding_layer_bytes"],
        "peak_whole_device_over_full": (peak + mem["sliding_layer_bytes"]) / full,
        "scratch_bytes": mem["scratch_bytes"],
        "prompt_stream_bytes": mem.get("prompt_stream_bytes", 0),
        "transients_over_full": (mem["scratch_bytes"] + mem.get("prompt_stream_bytes", 0)) / full,
        "prompt_h2d_bytes": traffic["totals"]["h2d_bytes"],
        "decode_h2d_median": traffic["per_decode_step_median"]["h2d_bytes"],
        "decode_host_read_median": traffic["per_decode_step_median"]["host_read_bytes"],
        "decode_full_cache_read": traffic["per_decode_step_median"]["full_cache_bytes"],
        "page_hit_rate": traffic["page_cache"]["hit_rate"],
        "prefill_s": round(prefill_s, 1),
    }
    cache.close()
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | gemma3-270m")
    p.add_argument("--lengths", default="8192", help="comma list of prompt lengths")
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--steps", type=int, default=8, help="decode steps after the prompt")
    p.add_argument("--codecs", default="exact,int8", help="exact: the prompt streamed; int8: held (comparison)")
    p.add_argument("--out", default=None, help="JSON lines of the rows")
    a = p.parse_args(argv)
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        for codec in a.codecs.split(","):
            row = measure(a.model, n, a.budget, a.steps, codec)
            rows.append(row)
            print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
