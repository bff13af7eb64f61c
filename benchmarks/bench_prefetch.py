"""Decode over a disk cold tier, prefetch off vs on (docs/design.md, "Data flow").

    python benchmarks/bench_prefetch.py [--dir /tmp] [--smollm-tokens 8192] [--tiny-tokens 65536]
                                        [--steps 24] [--threads 2] [--skip-smollm] [--skip-tiny]
                                        [--store disk|lmdb] [--batch-ab] [--top-k K]
                                        [--queue fifo|urgent|now] [--share-heads] [--prefill-queries N]

Per model: one prefill with cold_store=disk (gpu_cache_limit = prefetch_window =
1024 by default), then two decode phases of --steps greedy tokens on the same
cache (each after one untimed warm-up step): prefetch off (every block read synchronously from the store), then on
(reads go through the Prefetcher that look-ahead fills). The page cache of the
store's segment files is dropped (fsync + posix_fadvise DONTNEED) before every
decode step, outside the timed region, so block reads come from the disk, not
RAM. Printed per phase: decode ms/token, stall time as % of decode time,
fetch hits/misses, disk bytes read, the disk tier's read bandwidth (bytes over
time spent in pread, all threads) and the demand rate (bytes over decode wall
time), against the raw sequential read bandwidth of a fresh file measured in
the same run the same way.

With --batch-ab a third phase runs prefetch on without queuing a step's missing
blocks together (FlashLayer.demand_batch off: the previous behaviour, one
synchronous read at a time), between off and on.

--queue sets how the prefetcher serves the prefetch-on phases: "fifo" (one queue,
a step's missing blocks wait behind earlier look-ahead loads, and a block leaves
the ready buffer when it is used: the behaviour before `Prefetcher.urgent_first`
and `keep_used`), "urgent" (a step's misses first) or "now" (urgent first, used
blocks kept: the defaults). Decoding is deterministic whatever the prefetcher
does, so runs of one command with different --queue read the same blocks in the
same steps: compare them across runs (phases of one run decode different steps,
and this model's greedy tokens settle into a loop whose selections barely move).
--share-heads sets lsa_share_heads (every KV head the same blocks);
--prefill-queries sets lsa_prefill_queries. The prompt goes in through
`flashmem.prefill` (model-level chunks of 8192 tokens).

Models: (a) SmolLM2-135M (`flashmem.load_model("smollm2")`) on
`flashmem.texts.load_text()`; (b) a tiny random Llama (4 layers, 4 KV
heads x 64 dims, fp32: 256 KiB per block) on random tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import flashmem
from flashmem_eval.benchkit import drop_segments, raw_sequential, tiny_llama_long

DROP = True  # --no-drop: measure with the page cache warm (fair to LMDB, whose mapped pages cannot be dropped)


def drop_store(cache) -> None:
    folder = getattr(cache.store, "path", None)
    if folder is not None and DROP:
        drop_segments(folder)


def set_prefetch(cache, on: bool) -> None:
    """Route the layers' reads through the cache's Prefetcher (on) or straight to the store (off)."""
    cache.use_prefetcher(on)


def decode_phase(
    model, cache, tok: torch.Tensor, steps: int, prefetch: bool, batch: bool = True, queue: str = "now"
) -> tuple[dict, torch.Tensor]:
    set_prefetch(cache, prefetch)
    for layer in cache.flash_layers:  # a step's missing blocks queued together (FlashLayer.demand_batch)
        layer.demand_batch = batch
    if cache.prefetcher is not None:
        cache.prefetcher.urgent_first = queue != "fifo"
        cache.prefetcher.keep_used = queue == "now"
    if cache.prefetcher is not None:
        cache.prefetcher.discard()
    with torch.no_grad():  # one untimed step so each phase starts in its steady state
        drop_store(cache)
        tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    s0 = cache.stats()
    f0 = cache.sync_reads()  # synchronous reads (prefetch off) are counted here
    wall = 0.0
    with torch.no_grad():
        for _ in range(steps):
            drop_store(cache)
            t0 = time.perf_counter()
            logits = model(tok, cache=cache, use_cache=True).logits[:, -1]
            wall += time.perf_counter() - t0
            tok = logits.argmax(-1, keepdim=True)
    s1 = cache.stats()
    if prefetch:
        hits, misses, stall = (s1[k] - s0[k] for k in ("hits", "misses", "stall_s"))
    else:
        hits = 0
        f1 = cache.sync_reads()
        misses = f1["misses"] - f0["misses"]
        stall = f1["stall_s"] - f0["stall_s"]
    tier = "disk" if "disk" in s1["tiers"] else "lmdb"
    d0, d1 = s0["tiers"][tier], s1["tiers"][tier]
    read = d1["bytes_read"] - d0["bytes_read"]
    read_s = d1.get("read_s", 0.0) - d0.get("read_s", 0.0)
    return {
        "prefetch": prefetch,
        "demand_batch": batch,
        "queue": queue,
        "disk_reads": d1.get("gets", 0) - d0.get("gets", 0),
        "steps": steps,
        "ms_per_token": 1e3 * wall / steps,
        "stall_pct": 100 * stall / wall,
        "stall_s": stall,
        "hits": hits,
        "misses": misses,
        "disk_bytes_read": read,
        "disk_read_MBps": read / read_s / 1e6 if read_s > 0 else 0.0,
        "demand_MBps": read / wall / 1e6,
        "pending_hits": d1.get("pending_hits", 0) - d0.get("pending_hits", 0),
    }, tok


def run_model(name, model, ids, args, raw) -> list[dict]:
    cfg = flashmem.FlashMemoryConfig(
        gpu_cache_limit=args.window,
        prefetch_window=args.window,
        cold_store=args.store,
        cold_dir=args.dir,
        cold_codec=args.codec,
        prefetch_threads=args.threads,
        lsa_top_k=args.top_k,
        lsa_share_heads=args.share_heads,
        lsa_prefill_queries=args.prefill_queries,
    )
    rows = []
    with flashmem.attach(model, cfg) as cache:
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = flashmem.prefill(model, cache, ids, chunk=8192)
        prefill = time.perf_counter() - t0
        cache.store.flush()
        rep = cache.memory_report()
        print(
            f"[{name}] prefill {ids.shape[1]} tokens in {prefill:.1f} s; sealed blocks {rep['sealed_blocks']}, "
            f"cold {rep['cold_bytes'] / 2**20:.1f} MiB, blocks selected/layer/step "
            f"{cfg.blocks_to_select(rep['sealed_blocks'] // max(1, len(cache.flash_layers)))} "
            f"({ids.shape[1] / prefill:.0f} tokens/s)",
            flush=True,
        )
        tok = logits[:, -1].argmax(-1, keepdim=True)
        phases = [(False, False), (True, False), (True, True)] if args.batch_ab else [(False, False), (True, True)]
        for prefetch, batch in phases:
            queue = args.queue if prefetch else "now"
            row, tok = decode_phase(model, cache, tok, args.steps, prefetch, batch, queue)
            row.update(model=name, context=int(ids.shape[1]), raw_seq_MBps=raw / 1e6, prefill_s=prefill)
            rows.append(row)
            print(
                f"[{name}] prefetch {'on ' if prefetch else 'off'}{' +batch' if batch else ''}"
                f"{' ' + queue if prefetch else ''}: "
                f"{row['ms_per_token']:7.1f} ms/token, "
                f"stall {row['stall_pct']:5.1f}% ({row['stall_s']:.2f} s), hits {row['hits']}, misses {row['misses']}, "
                f"disk read {row['disk_bytes_read'] / 2**20:.0f} MiB at {row['disk_read_MBps']:.0f} MB/s in pread "
                f"({row['disk_read_MBps'] / (raw / 1e6):.2f}x raw sequential {raw / 1e6:.0f} MB/s), "
                f"demand {row['demand_MBps']:.0f} MB/s",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--smollm-tokens", type=int, default=8192)
    ap.add_argument("--tiny-tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--codec", default="exact")
    ap.add_argument("--raw-mib", type=int, default=256)
    ap.add_argument("--skip-smollm", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--store", choices=["disk", "lmdb"], default="disk")
    ap.add_argument("--batch-ab", action="store_true", help="also run prefetch on without queuing a step's misses")
    ap.add_argument("--top-k", type=int, default=None, help="lsa_top_k (default: lsa_keep_ratio)")
    ap.add_argument("--queue", choices=["fifo", "urgent", "now"], default="now", help="prefetcher queue (see above)")
    ap.add_argument("--share-heads", action="store_true", help="lsa_share_heads: true")
    ap.add_argument("--prefill-queries", type=int, default=0, help="lsa_prefill_queries")
    ap.add_argument(
        "--no-drop", action="store_true", help="keep the page cache (LMDB's touched pages stay mapped anyway)"
    )
    args = ap.parse_args()
    global DROP
    DROP = not args.no_drop
    torch.set_num_threads(1)

    raw = raw_sequential(args.dir, args.raw_mib * 2**20)
    print(f"raw sequential read (fresh file, page cache dropped): {raw / 1e6:.0f} MB/s", flush=True)
    rows = []
    if not args.skip_tiny:
        model = tiny_llama_long(args.tiny_tokens)
        ids = torch.randint(0, 1024, (1, args.tiny_tokens), generator=torch.Generator().manual_seed(0))
        rows += run_model("tiny-llama", model, ids, args, raw)
        del model
    if not args.skip_smollm:
        from flashmem.texts import load_text

        t0 = time.perf_counter()
        model, tok = flashmem.load_model("smollm2")
        print(f"[smollm2] loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        ids = tok(load_text(), return_tensors="pt").input_ids[:, : args.smollm_tokens]
        rows += run_model("smollm2", model, ids, args, raw)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
