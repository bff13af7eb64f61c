"""The process's RSS decode step by step with a disk cold tier, over the budget: each step's peak
(VmHWM reset before it), its end, its end with the heap's free pages handed back, and its time;
and the disk tier's reads a step (median).

`benchmarks/budget_peak.py` gives the decode steps' peak as one figure; this says which step it
is and what a step adds over what is held between steps. The baseline is the RSS after
`flashmem.attach` with the heap trimmed; `--warm` runs the request once before (the second
request's rows are the ones a serving process sees). Each row over the budget's bytes (budget x
the full cache of the managed layers at the prompt's length):

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/diagnostics/decode_rss_steps.py \\
        --model smollm2 --tokens 8192 --budget 0.125 --steps 12 --warm
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import flashmem
from flashmem.cache.host_heap import release_free_memory
from flashmem.cache.scratch import thread_scratch
from flashmem.sizing.budget import full_kv_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from budget_peak import QUESTION, _reset_peak_rss  # noqa: E402


def _status_kib(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB, from one read of it: VmHWM and VmRSS read apart can
    see the RSS grow in between (the peak then reads below the end)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        lines = []
    got = {ln.split(":")[0]: int(ln.split()[1]) for ln in lines if ln.split(":")[0] in fields}
    if len(got) < len(fields):
        raise SystemExit(f"decode_rss_steps: no {', '.join(fields)} in /proc/self/status (Linux only)")
    return got


def _kib(field: str) -> int:
    return _status_kib(field)[field]


def request(
    model: Any, tok: Any, ids: torch.Tensor, budget: float, steps: int, chunk: int, threads: int = 0
) -> dict[str, Any]:
    """One request on a fresh disk-tier cache -> its rows, over the budget's bytes."""
    with tempfile.TemporaryDirectory(prefix="decode_rss_") as cold:
        keys = dict(cold_store="disk", cold_dir=cold, prefetch_threads=threads, cold_pending_mb=4)
        cache = flashmem.attach(model, budget=budget, tokens=ids.shape[1] + steps, tokenizer=tok, **keys)
        managed = full_kv_bytes(model, ids.shape[1], model.dtype.itemsize)["managed_bytes"]
        over = 1024 / (budget * managed)  # KiB -> bytes -> over the budget
        # attention's reused buffers (cache/scratch.py) outlive a cache in its thread: an earlier
        # request's would sit in the baseline and hide this one's, so they go first
        thread_scratch().clear()
        release_free_memory()
        base = _kib("VmRSS")
        nxt = flashmem.prefill(model, cache, ids, chunk=chunk)[:, -1:].argmax(-1)
        release_free_memory()
        # the baseline itself: what an earlier request left resident (freed, kept by the allocator)
        # is below it and reused, so trees that free differently compare by base + rows
        out: dict[str, Any] = {
            "base_mib": round(base / 1024, 2),
            "budget_mib": round(budget * managed / 2**20, 2),
            "prompt_end": (_kib("VmRSS") - base) * over,
            "steps": [],
        }
        with torch.no_grad():
            for _ in range(steps):
                _reset_peak_rss()
                t0 = time.perf_counter()
                nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                seconds = time.perf_counter() - t0
                now = _status_kib("VmHWM", "VmRSS")
                peak, end = now["VmHWM"], now["VmRSS"]
                release_free_memory()
                row = {
                    k: round((v - base) * over, 3)
                    for k, v in (("peak", peak), ("end", end), ("trimmed", _kib("VmRSS")))
                }
                out["steps"].append(row | {"ms": round(1000 * seconds, 1)})
        out["disk_read_bytes_per_step"] = cache.traffic_report()["per_decode_step_median"]["disk_read_bytes"]
        cache.close()
    release_free_memory()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a packaged model (smollm2, gemma3-270m) or tiny")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--forward-tokens", type=int, default=512, help="prompt tokens per forward")
    p.add_argument("--text", default="kjv", help="the prompt's text (a packaged model's tokenizer)")
    p.add_argument("--warm", action="store_true", help="the same request once before, its rows dropped")
    p.add_argument("--prefetch-threads", type=int, default=0, help="prefetch_threads (0: reads go to the store)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if a.model == "tiny":
        from flashmem_eval.benchkit import tiny_llama_long

        model, tok = tiny_llama_long(a.tokens), None
        ids = torch.randint(0, model.config.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    else:
        from flashmem.texts import haystack

        model, tok = flashmem.load_model(a.model)
        body = haystack(tok, a.tokens - 40, seed=0, name=a.text)
        prompt = body + f"\n\nQuestion: {QUESTION}\nAnswer:"
        ids = torch.tensor([tok(prompt)["input_ids"][: a.tokens]])
    if a.warm:
        request(model, tok, ids, a.budget, a.steps, a.forward_tokens, a.prefetch_threads)
    row = {
        "model": a.model,
        "tokens": a.tokens,
        "budget": a.budget,
        "warm": a.warm,
        "prefetch_threads": a.prefetch_threads,
    }
    row |= request(model, tok, ids, a.budget, a.steps, a.forward_tokens, a.prefetch_threads)
    print(f"baseline RSS {row['base_mib']:.1f} MiB, budget {row['budget_mib']:.1f} MiB")
    print(f"prompt in: {row['prompt_end']:.3f}x the budget")
    for i, s in enumerate(row["steps"]):
        print(f"step {i:3d}: peak {s['peak']:.3f}  end {s['end']:.3f}  trimmed {s['trimmed']:.3f}  {s['ms']:.0f} ms")
    print(f"disk reads a step (median): {row['disk_read_bytes_per_step'] / 1e6:.1f} MB")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
