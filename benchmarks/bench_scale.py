"""Context length up to 2^20 tokens on one CPU box: flashmem (disk cold tier) vs DynamicCache.

    python benchmarks/bench_scale.py [--lengths 16384,65536,262144,1048576] [--steps 16]
                                     [--dir /tmp] [--json results/scale_tiny.json]
                                     [--plot results/scale_tiny.png] [--dynamic-max 1048576]
                                     [--methods flashmem,flashmem-shared,dynamic] [--prefill-queries 64]

Model: the tiny random Llama of `flashmem_eval.benchkit.tiny_llama_long` (4 layers, hidden 256, 4 KV
heads x 64 dims, fp32: 8 KiB of K/V per token) on random tokens. Every length
runs in its own process, so its peak RSS (ru_maxrss) is its own.

flashmem: cold_store=disk (the memory store keeps every block in RAM by
design), window 1024, 16 blocks of 128 selected per layer and step, summaries
off; the prompt goes in through `flashmem.prefill` (model-level chunks of 8192
tokens), then `--steps` greedy decode steps (after one untimed one), prefetch on,
with the store's page cache dropped before every step (outside the timed
region). Method `flashmem-shared`: the same with `lsa_share_heads: true` (the 4
KV heads select the same blocks, so a step reads up to 4x fewer). --prefill-queries
sets `lsa_prefill_queries` (a prefill chunk's selection from that many of its queries). Reported: peak RSS, device-resident bytes, cold bytes on disk, prefill
tokens/s, median decode ms/token, stall % of decode time.

DynamicCache: the same model with SDPA attention. Its prefill is O(n^2) and
would take hours on 2 cores beyond 64K, so the cache is filled with random K/V
of the length (decode cost and memory do not depend on the values) and only
decode is timed; up to --dynamic-prefill-max tokens it is prefilled for real
(chunked) to give prefill tokens/s. At 2^20 tokens it decodes min(--steps, 4)
steps (each copies the whole 8 GiB cache). The memory a full cache needs at each
length comes from `flashmem.estimate`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MACHINE_RAM = 24 * 10**9


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def model_for(tokens: int):
    from flashmem_eval.benchkit import tiny_llama_long

    return tiny_llama_long(tokens)


def load() -> float:
    return os.getloadavg()[0]


def run_flashmem(n: int, args, share_heads: bool = False) -> dict:
    import flashmem
    from flashmem_eval.benchkit import drop_segments

    model = model_for(n)
    ids = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(0))
    cfg = flashmem.FlashMemoryConfig(
        gpu_cache_limit=1024,
        prefetch_window=1024,
        lsa_top_k=16,
        use_summaries=False,
        cold_store="disk",
        cold_dir=args.dir,
        prefetch_threads=2,
        lsa_share_heads=share_heads,
        **({} if args.prefill_queries is None else {"lsa_prefill_queries": args.prefill_queries}),
    )
    method = "flashmem-shared" if share_heads else "flashmem"
    row: dict = {"method": method, "tokens": n, "load_start": load(), "lsa_prefill_queries": cfg.lsa_prefill_queries}
    with flashmem.attach(model, cfg) as cache:
        t0 = time.perf_counter()
        logits = flashmem.prefill(model, cache, ids, chunk=args.chunk)
        row["prefill_s"] = time.perf_counter() - t0
        row["prefill_tokens_per_s"] = n / row["prefill_s"]
        row["rss_after_prefill"] = peak_rss()
        cache.store.flush()
        tok = logits[:, -1].argmax(-1, keepdim=True)
        folder = cache.store.path
        times = []
        with torch.no_grad():
            drop_segments(folder)
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            s0 = cache.stats()
            for _ in range(args.steps):
                drop_segments(folder)
                t1 = time.perf_counter()
                tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - t1)
            s1 = cache.stats()
        rep = cache.memory_report()
        row.update(
            decode_ms_median=1e3 * statistics.median(times),
            decode_ms=[1e3 * t for t in times],
            stall_pct=100 * (s1["stall_s"] - s0["stall_s"]) / sum(times),
            hits=s1["hits"] - s0["hits"],
            misses=s1["misses"] - s0["misses"],
            device_resident_bytes=rep["device_resident_bytes"],
            peak_managed_resident_bytes=rep["peak_managed_resident_bytes"],
            tiers=rep["tiers"],
            cold_bytes=rep["cold_bytes"],
        )
    row["peak_rss"] = peak_rss()
    row["load_end"] = load()
    return row


def run_dynamic(n: int, args) -> dict:
    from transformers import DynamicCache

    model = model_for(n)
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    row: dict = {"method": "dynamic", "tokens": n, "load_start": load()}
    cache = DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if n <= args.dynamic_prefill_max:
            ids = torch.randint(0, 1024, (1, n), generator=gen)
            t0 = time.perf_counter()
            for a in range(0, n, args.chunk):
                out = model(ids[:, a : a + args.chunk], cache=cache, use_cache=True, logits_to_keep=1)
            row["prefill_s"] = time.perf_counter() - t0
            row["prefill_tokens_per_s"] = n / row["prefill_s"]
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            row["filled"] = "prefill"
        else:
            for i in range(cfg.num_hidden_layers):
                k = torch.randn(1, hkv, n, d, generator=gen)
                cache.update(k, torch.randn(1, hkv, n, d, generator=gen), i)
                del k
            tok = torch.zeros(1, 1, dtype=torch.long)
            row["filled"] = "random K/V (prefill skipped: O(n^2))"
        times = []
        tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        # each DynamicCache step copies the whole cache (torch.cat): a few steps at 1M
        steps = args.steps if n < 2**20 else min(args.steps, 4)
        for _ in range(steps):
            t1 = time.perf_counter()
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t1)
    row.update(
        decode_ms_median=1e3 * statistics.median(times),
        decode_ms=[1e3 * t for t in times],
        device_resident_bytes=sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers),
        peak_rss=peak_rss(),
        load_end=load(),
    )
    return row


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    panels = [
        ("peak_rss", "peak RSS (GB)", 1e-9),
        ("device_resident_bytes", "device-resident KV (MB)", 1e-6),
        ("decode_ms_median", "decode ms/token (median)", 1.0),
        ("prefill_tokens_per_s", "prefill tokens/s", 1.0),
    ]
    for ax, (key, label, scale) in zip(axes, panels):
        for method, style, name in (
            ("flashmem", "o-", "flashmem (disk tier)"),
            ("flashmem-shared", "^-", "flashmem, heads share pages"),
            ("dynamic", "s--", "DynamicCache"),
        ):
            pts = [(r["tokens"], r[key] * scale) for r in rows if r["method"] == method and key in r]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("tiny random Llama (4 layers, 8 KiB K/V per token), 2-core CPU, 24 GB RAM", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384,65536,262144,1048576")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=8192, help="model-level prefill chunk")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default="results/scale_tiny.json")
    ap.add_argument("--plot", default="results/scale_tiny.png")
    ap.add_argument("--methods", default="flashmem,dynamic")
    ap.add_argument("--dynamic-max", type=int, default=2**20, help="longest DynamicCache run")
    ap.add_argument("--dynamic-prefill-max", type=int, default=16384, help="longest real DynamicCache prefill")
    ap.add_argument("--prefill-queries", type=int, default=None, help="lsa_prefill_queries (default: the config's)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)  # 2 shared cores: one for compute, one for the prefetch/writer threads
    if args.child:
        if args.child == "dynamic":
            row = run_dynamic(args.tokens, args)
        else:
            row = run_flashmem(args.tokens, args, share_heads=args.child == "flashmem-shared")
        print("ROW " + json.dumps(row), flush=True)
        return

    import flashmem

    rows: list[dict] = []
    if os.path.exists(args.json):  # resume: keep rows already measured
        rows = json.load(open(args.json, encoding="utf-8"))["rows"]
    for n in [int(x) for x in args.lengths.split(",")]:
        est = flashmem.estimate(tokens=n, layers=4, kv_heads=4, head_dim=64, dtype="float32")
        for method in args.methods.split(","):
            if method == "dynamic" and n > args.dynamic_max:
                continue
            rows = [r for r in rows if not (r["method"] == method and r["tokens"] == n)]
            cmd = [sys.executable, __file__, "--child", method, "--tokens", str(n), "--steps", str(args.steps)]
            cmd += ["--chunk", str(args.chunk), "--dir", args.dir]
            cmd += ["--dynamic-prefill-max", str(args.dynamic_prefill_max)]
            if args.prefill_queries is not None:
                cmd += ["--prefill-queries", str(args.prefill_queries)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            if proc.returncode or not lines:
                print(f"{method} {n}: failed (rc {proc.returncode}): {proc.stderr[-2000:]}", flush=True)
                continue
            row = json.loads(lines[-1][4:])
            row["full_cache_bytes_estimate"] = est.full_cache_bytes
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(
                f"{method:8s} {n:>8d}: peak RSS {row['peak_rss'] / 1e9:.2f} GB, resident "
                f"{row['device_resident_bytes'] / 1e6:.1f} MB, cold {row.get('cold_bytes', 0) / 1e9:.2f} GB, "
                f"prefill {row.get('prefill_tokens_per_s', float('nan')):.0f} tok/s, decode "
                f"{row['decode_ms_median']:.1f} ms/token, stall {row.get('stall_pct', 0):.1f}%, "
                f"load {row['load_start']:.1f}-{row['load_end']:.1f}",
                flush=True,
            )
            rows.sort(key=lambda r: (r["tokens"], r["method"]))
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(
                    {"args": {k: v for k, v in vars(args).items() if k not in ("child", "tokens")}, "rows": rows},
                    f,
                    indent=1,
                )
    # Where a full cache stops fitting in this machine's RAM (K/V alone, from flashmem.estimate).
    per_token = flashmem.estimate(tokens=1, layers=4, kv_heads=4, head_dim=64, dtype="float32").bytes_per_token
    print(f"DynamicCache K/V alone exceeds {MACHINE_RAM / 1e9:.0f} GB at {MACHINE_RAM // per_token} tokens")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
