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

With `--rank-on-host` the re-rank scores its candidates where the cold tier holds them (as
on an accelerator; `BlockReader.rank_on_host`), and the row gives the link's bytes per decode
step over the bytes of the pages that step newly attends (`h2d_over_new_pages`). With
`--cold-store disk` the row also gives the process's RSS against the budget (on a CPU the disk
tier is what takes the cold K/V out of RAM), over its RSS before the prompt, which is taken after
one forward without a cache of `--forward-tokens` tokens (the prompt's forwards are as long, so
the model's own first-forward memory is not counted) and with the C heap's free pages handed back
(cache/host_heap.py): the prompt's peak (the model's activations for a forward included; that
forward alone: `rss_forward_peak_over_budget`), the RSS when the prompt is in, the decode steps'
peak, what is left after them with the free pages handed back (`rss_retained_over_budget`), and
attention's reused buffers (`scratch_over_budget`), all over the budget's bytes.
`--warm-process` serves the request once before the measured one, in the same process, so the
RSS leaves out what a process pays once (library code paged in, imports); `--host-mmap-threshold
N` sets the config's `host_mmap_threshold` (glibc's threshold fixed, process-wide).

    python benchmarks/budget_peak.py --model tiny --lengths 8192,32768 --budget 0.125
    python benchmarks/budget_peak.py --model smollm2 --lengths 4096,8192 --budget 0.0625
    python benchmarks/budget_peak.py --model tiny --lengths 32768,131072 --budget 0.0625 \
        --codecs exact --rank-on-host --prefill-chunk 4096 --steps 64

With `--text kjv` (or stdlib-doc) the prompt is real text and a question, so the decode steps
answer it: their page and candidate hit rates are those of a real answer (random tokens keep
a flat attention). `--rerank-codec int4 --rerank-on-device` holds the candidates' codes on
the device; the row then gives their hit rate (`candidate_hit_rate`). `--as-device` takes the
config the solver gives an accelerator (`budget_config(..., device_codes=True)`: the codes and
`lsa_cache_pages` where the selected-token cap leaves room); `--cache-pages N` sets the page
cache alone (`page_hit_rate` counts a page the cache held as a hit).

`--live-bytes` also counts every tensor alive at once through the request, the cold tier left
out (flashmem_eval/live_bytes.py: what `torch.cuda.max_memory_allocated` would read, the model's
activations included, which `memory_report()` does not see): `live_peak_over_budget`, beside
`live_forward_peak_over_budget`, the same count for one prompt chunk's forward with no cache.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import flashmem
from flashmem.cache.block_reads import BlockReader
from flashmem.cache.host_heap import release_free_memory
from flashmem.cache.prefill import DEFAULT_CHUNK
from flashmem.cache.scratch import thread_scratch
from flashmem.sizing.budget import full_kv_bytes
from flashmem_eval.live_bytes import LiveBytes

QUESTION = "What is the passage above about? Name the people in it."


def _model(name: str, tokens: int) -> tuple[Any, Any]:
    if name == "tiny":
        from flashmem_eval.benchkit import tiny_llama_long

        return tiny_llama_long(tokens), None
    return flashmem.load_model(name)


def _rss_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process in KiB (Linux), None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(
    name: str,
    tokens: int,
    budget: float,
    steps: int,
    codec: str,
    cold_store: str = "memory",
    prefill_chunk: int | None = None,
    cold_pending_mb: int = 256,
    text: str | None = None,
    text_seed: int = 0,
    extra: dict[str, Any] | None = None,
    as_device: bool = False,
    question: str = QUESTION,
    live_bytes: bool = False,
    variant: str = "default",
    forward_tokens: int = DEFAULT_CHUNK,
    warm: bool = False,
) -> dict[str, Any]:
    if warm:  # the same request once before, its row dropped: the process has served one
        measure(
            name, tokens, budget, steps, codec, cold_store, prefill_chunk, cold_pending_mb, text, text_seed,
            extra, as_device, question, False, variant, forward_tokens,
        )  # fmt: skip
    model, tok = _model(name, tokens)
    vocab = model.config.vocab_size
    if text and tok is not None:  # real text and a question, so the decode steps answer something
        from flashmem.texts import haystack

        body = haystack(tok, tokens - 40, seed=text_seed, name=text)
        prompt = body + f"\n\nQuestion: {question}\nAnswer:"
        ids = torch.tensor([tok(prompt, add_special_tokens=True)["input_ids"][:tokens]])
    else:
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    keys: dict[str, Any] = {"cold_codec": codec, **(extra or {})}
    tmp = None
    if cold_store == "disk":
        tmp = tempfile.TemporaryDirectory(prefix="budget_peak_")
        keys.update(cold_store="disk", cold_dir=tmp.name, prefetch_threads=0, cold_pending_mb=cold_pending_mb)
    if prefill_chunk:
        keys["prefill_chunk"] = prefill_chunk
    if as_device:  # the config an accelerator gets: codes and a page cache where the cap leaves room
        from flashmem.sizing.budget import budget_config, model_geometry

        device_cfg = budget_config(budget, tokens + steps, variant, **model_geometry(model), device_codes=True, **keys)
        cache = flashmem.attach(model, device_cfg, tokenizer=tok)
    elif variant != "default":
        cfg = flashmem.FlashMemoryConfig.for_budget(budget, tokens + steps, model, variant=variant, **keys)
        cache = flashmem.attach(model, cfg, tokenizer=tok)
    else:
        cache = flashmem.attach(model, budget=budget, tokens=tokens + steps, tokenizer=tok, **keys)
    # the baseline after one forward of a prompt chunk with no cache, as long as the prompt's
    # forwards: the model's own first forward keeps about 0.5 GB (SmolLM2, 512 tokens: its
    # activations and logits, held by the allocator), which is not the cache's part. The C heap's
    # free pages go back to the OS before each baseline, so what glibc kept is not counted.
    release_free_memory()
    rss_w = _rss_kib("VmRSS") if _reset_peak_rss() else None
    forward_live = LiveBytes() if live_bytes else contextlib.nullcontext()
    with torch.no_grad(), forward_live:  # the last position's logits only, as flashmem.prefill's forwards
        model(ids[:, :forward_tokens], use_cache=False, logits_to_keep=1)
    # what that forward alone raised the peak by: the model's part of a chunk's peak, for comparison
    hwm_w = _rss_kib("VmHWM")
    forward_peak = None if rss_w is None or hwm_w is None else (hwm_w - rss_w) * 1024
    # attention's reused buffers outlive a cache in its thread (cache/scratch.py): a warm
    # process's earlier request would leave its own in the baseline, hiding this one's
    thread_scratch().clear()
    release_free_memory()
    rss0 = _rss_kib("VmRSS")
    rss_ok = _reset_peak_rss() and rss0 is not None
    live = LiveBytes(exclude=("store.",)) if live_bytes else contextlib.nullcontext()
    with live:
        t0 = time.perf_counter()
        logits = flashmem.prefill(model, cache, ids, chunk=forward_tokens)
        prefill_s = time.perf_counter() - t0
        rss_prompt_peak = _rss_kib("VmHWM")
        rss_prompt_end = _rss_kib("VmRSS")  # flashmem.prefill trimmed the heap with a disk tier
        _reset_peak_rss()
        nxt = logits[:, -1:].argmax(-1)
        with torch.no_grad():
            for _ in range(steps):
                nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    rss_decode_peak = _rss_kib("VmHWM")
    release_free_memory()
    rss_retained = _rss_kib("VmRSS")  # what the cache (and its store) holds live after the request
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
        # a disk cold tier's reads (the slow tier there): blocks the prefetcher's buffer lacked
        "decode_disk_read_median": traffic["per_decode_step_median"]["disk_read_bytes"],
        "decode_full_cache_read": traffic["per_decode_step_median"]["full_cache_bytes"],
        "page_hit_rate": traffic["page_cache"]["hit_rate"],
        # re-rank candidates whose codes the device held over (lsa_rerank_on_device), else None
        "candidate_hit_rate": traffic.get("candidate_cache", {}).get("hit_rate"),
        "prompt": f"{text} seed {text_seed}" if text and tok is not None else "random tokens",
        "question": question if text and tok is not None else None,
        "config": {
            k: getattr(cache.cfg, k)
            for k in ("lsa_top_k", "lsa_rerank_codec", "lsa_rerank_on_device", "lsa_cache_pages")
        },
        "as_device": as_device,
        "rank_on_host": bool(BlockReader.rank_on_host),
        "decode_new_page_bytes_median": traffic["per_decode_step_median"]["new_page_bytes"],
        # the link's bytes over the bytes of the pages each decode step newly attends (median)
        "h2d_over_new_pages": traffic["h2d_over_new_pages_median"],
        "decode_h2d_over_full_cache": traffic["per_decode_step_median"]["h2d_bytes"] / full if full else None,
        "decode_host_read_over_full_cache": traffic["per_decode_step_median"]["host_read_bytes"] / full
        if full
        else None,
        "decode_disk_read_over_full_cache": traffic["per_decode_step_median"]["disk_read_bytes"] / full
        if full
        else None,
        "cold_store": cold_store,
        # glibc's large-allocation threshold, when set: RSS depends on it (docs/results.md)
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "host_mmap_threshold": cache.cfg.host_mmap_threshold,
        "cold_pending_mb": cold_pending_mb if cold_store == "disk" else None,
        "prefill_chunk": cache.cfg.prefill_chunk,
        "prefill_s": round(prefill_s, 1),
        "forward_tokens": forward_tokens,
        "warm_process": warm,
    }
    if isinstance(live, LiveBytes) and isinstance(forward_live, LiveBytes):
        row["live_peak_over_budget"] = live.peak / (budget * managed_full)
        row["live_forward_peak_over_budget"] = forward_live.peak / (budget * managed_full)
        row["live_at_peak"] = live.summary(6)["at_peak"]  # bytes by the flashmem function that made them
    if rss_ok and None not in (rss_prompt_peak, rss_prompt_end, rss_decode_peak, rss_retained):
        # the process's RSS over its RSS before the prompt (KiB -> bytes), over the budget's bytes:
        # the cache's part, transients (attention's buffers, blocks read back) included, in RAM;
        # the prompt's peak also holds the model's activations for a forward (rss_forward_...)
        over = 1024 / (budget * managed_full)
        row["rss_prompt_peak_over_budget"] = (rss_prompt_peak - rss0) * over  # type: ignore[operator]
        row["rss_prompt_end_over_budget"] = (rss_prompt_end - rss0) * over  # type: ignore[operator]
        row["rss_decode_peak_over_budget"] = (rss_decode_peak - rss0) * over  # type: ignore[operator]
        row["rss_peak_over_budget"] = max(row["rss_prompt_peak_over_budget"], row["rss_decode_peak_over_budget"])
        row["rss_retained_over_budget"] = (rss_retained - rss0) * over  # type: ignore[operator]
        row["scratch_over_budget"] = mem["scratch_bytes"] / (budget * managed_full)
        if forward_peak is not None:  # one chunk's forward without a cache, from the same start
            row["rss_forward_peak_over_budget"] = forward_peak / (budget * managed_full)
    cache.close()
    if tmp is not None:
        tmp.cleanup()
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | smollm2 | gemma3-270m")
    p.add_argument("--lengths", default="8192", help="comma list of prompt lengths")
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--steps", type=int, default=8, help="decode steps after the prompt")
    p.add_argument("--codecs", default="exact,int8", help="exact: the prompt streamed; int8: held (comparison)")
    p.add_argument("--cold-store", default="memory", choices=["memory", "disk"], help="the cold tier")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per forward (default: the recipe's)")
    p.add_argument("--cold-pending-mb", type=int, default=256, help="disk tier: MiB of blocks held before written")
    p.add_argument(
        "--rank-on-host", action="store_true", help="score re-rank candidates where the cold tier holds them"
    )
    p.add_argument("--text", default=None, help="a haystack text (kjv, stdlib-doc) as the prompt, not random tokens")
    p.add_argument("--text-seed", type=int, default=0, help="where in the text the prompt starts")
    p.add_argument("--question", default=QUESTION, help="with --text: the question after the passage")
    p.add_argument("--rerank-codec", default=None, help="lsa_rerank_codec (default: the recipe's)")
    p.add_argument("--rerank-on-device", action="store_true", help="lsa_rerank_on_device: true")
    p.add_argument(
        "--as-device",
        action="store_true",
        help="the recipe an accelerator gets (candidate codes and lsa_cache_pages where the cap leaves room), "
        "not the CPU's",
    )
    p.add_argument("--cache-pages", type=int, default=None, help="lsa_cache_pages (default: the recipe's)")
    p.add_argument(
        "--host-mmap-threshold", type=int, default=None, help="host_mmap_threshold: fix glibc's mmap threshold (bytes)"
    )
    p.add_argument(
        "--live-bytes", action="store_true", help="count every tensor alive at once (slower): live_peak_over_budget"
    )
    p.add_argument(
        "--variants", default="default", help="comma list: the recipe (default) or evaluation variants (wincap32, ...)"
    )
    p.add_argument(
        "--forward-tokens",
        type=int,
        default=DEFAULT_CHUNK,
        help="prompt tokens per model forward (flashmem.prefill's chunk), the same for the warm-up forward",
    )
    p.add_argument(
        "--warm-process",
        action="store_true",
        help="run each request once before the measured one, in the same process: the RSS then leaves out "
        "what a process pays once (library code paged in, modules imported, first-call allocations)",
    )
    p.add_argument("--out", default=None, help="JSON lines of the rows")
    a = p.parse_args(argv)
    extra: dict[str, Any] = {}
    if a.rerank_codec:
        extra["lsa_rerank_codec"] = a.rerank_codec
    if a.rerank_on_device:
        extra["lsa_rerank_on_device"] = True
    if a.cache_pages is not None:
        extra["lsa_cache_pages"] = a.cache_pages
    if a.host_mmap_threshold is not None:
        extra["host_mmap_threshold"] = a.host_mmap_threshold
    # a class-wide switch: put back after the run (the smoke tests run this script in-process)
    was = BlockReader.rank_on_host
    if a.rank_on_host:
        BlockReader.rank_on_host = True
    rows = []
    try:
        for n in (int(x) for x in a.lengths.split(",")):
            for codec, variant in itertools.product(a.codecs.split(","), a.variants.split(",")):
                row = measure(
                    a.model, n, a.budget, a.steps, codec, a.cold_store, a.prefill_chunk, a.cold_pending_mb,
                    a.text, a.text_seed, extra, a.as_device, a.question, a.live_bytes, variant,
                    a.forward_tokens, a.warm_process,
                )  # fmt: skip
                rows.append({**row, "variant": variant})
                print(json.dumps(rows[-1]))
    finally:
        BlockReader.rank_on_host = was
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
