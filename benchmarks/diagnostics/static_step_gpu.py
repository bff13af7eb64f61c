"""The static decode step on a GPU: eager, static, and static replayed from CUDA graphs.

The H200 runs found flashmem's decode step bound by the host: about 63 us of Python per
kernel and 63 host waits a step, against 0.85 us per kernel replayed from a CUDA graph
(docs/accelerator.md). `decode_step: static` (cache/static_step.py) runs the steps between two
seals with fixed shapes and no host reads. This measures, on gpu_check's model (a random
Llama with Llama-3.1-8B's attention, 4 layers, bf16, batch 1, cuDNN's attention off), per length:

- `dynamic`: DynamicCache in HBM, filled with random K/V;
- `eager`: flashmem at `--budget` with `lsa_rerank: 1` (what the static step ranks by), the
  eager step; with `--rerank-codes`, re-ranked as the recipe (4x the pages) by the candidates'
  int4 key codes held on the device (the static step's re-rank);
- `static`: the same cache, `decode_step: static`;
- `graph`: the same with `decode_step: graph` (cache/step_graph.py): each layer's
  `device_step` captured in a CUDA graph once per segment (the segment's first step fills the
  working set and its second warms up, both eagerly; the third is captured; the rest replay it
  with the step's inputs copied into the graph's), its attention buffers from a pool the
  layers' graphs share.

Per mode: decode ms a step (median and mean over `--steps`, so a segment's captures count),
under torch.profiler the kernels, copies and synchronisations a step, and where the host
waits (`gpu_step_anatomy.sync_points`). First, at a short length in fp32 on the device, the
three modes' logits against each other (`exactness`). The cold tier is read through a mapped
view of its pinned memory when CuPy is importable (`store/mapped.py`); without it the static
step's gather waits for the ids, and a capture fails: recorded, the other modes still run.

    python3 benchmarks/diagnostics/static_step_gpu.py --out results/static_step_h200.json
    python3 benchmarks/diagnostics/static_step_gpu.py --rerank-codes --out results/static_step_rerank_h200.json
    python benchmarks/diagnostics/static_step_gpu.py --device cpu --smoke --emulate-graphs --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import gpu_step_anatomy as anatomy  # noqa: E402

import flashmem  # noqa: E402
import gpu_check as gc  # noqa: E402
from flashmem.cache import step_graph  # noqa: E402


@contextlib.contextmanager
def emulated_graphs(on: bool) -> Iterator[None]:
    """While on, `decode_step: graph` captures with step_graph.EmulatedGraph (a CPU's stand-in)."""
    was = step_graph.GRAPH
    step_graph.GRAPH = step_graph.EmulatedGraph if on else was
    try:
        yield
    finally:
        step_graph.GRAPH = was


def set_mode(cache: Any, step: str, share: float | None) -> None:
    """Every managed layer's decode_step, and lsa_fetch_share when not eager (the segments restart)."""
    for layer in cache.flash_layers:
        layer.cfg = layer.cfg.model_copy(
            update={"decode_step": step, "lsa_fetch_share": share if step != "eager" else None}
        )
        layer.static = None


def mode_section(
    model: Any, cache: Any, start: int, steps: int, device: torch.device, emulate: bool = False
) -> dict[str, Any]:
    """Decode ms per step in the cache's current mode, its profile and its host waits."""
    kw = gc.cache_kw(model)
    nxt = anatomy.token_stream(model, device, start)
    out: dict[str, Any] = {}
    before = cache.memory_report()
    with emulated_graphs(emulate):
        ms = gc.timed_decode(model, cache, start, steps, 2, device)
        out.update(decode_ms_median=statistics.median(ms), decode_ms_mean=statistics.fmean(ms), decode_ms=ms)
        with torch.no_grad():
            out["profile"] = anatomy.profile_steps(lambda: model(nxt(), use_cache=True, **{kw: cache}), 3, device)
            out["sync_points"] = anatomy.sync_points(lambda: model(nxt(), use_cache=True, **{kw: cache}), device)
    after = cache.memory_report()
    if cache.flash_layers[0].cfg.decode_step == "graph":
        out["graphs"] = {
            n: after[f"static_graph_{n}"] - before[f"static_graph_{n}"] for n in ("captures", "replays", "failures")
        }
        why = [
            s.graph.failed for s in (layer.static for layer in cache.flash_layers) if s and s.graph and s.graph.failed
        ]
        if why:
            out["graphs"]["failure"] = why[0]
    steps_ = [layer.static for layer in cache.flash_layers if layer.static is not None]
    if steps_:
        s = steps_[0]
        out["static"] = {"k": s.k, "fetch": s.fetch, "arena_on": str(s.arena[0].device), "candidates": s.C}
        if s.rerank:
            out["static"]["codes_on"] = str(s.code_arena[0].device)
    return out


def length_section(model: Any, tokens: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    res: dict[str, Any] = {"tokens": tokens}
    dyn = gc.fill_dynamic(model, tokens, device)
    ms = gc.timed_decode(model, dyn, tokens, args.steps, 2, device)
    res["dynamic"] = {"decode_ms_median": statistics.median(ms), "decode_ms_mean": statistics.fmean(ms)}
    del dyn
    gc.reset_peak(device)
    # what the static step supports, for both modes: no re-rank or one by codes on the device, no
    # page cache (the accelerator's recipe gives the room to one), no rest entry; checked now, not
    # when a mode switches
    cfg = gc.recipe_config(
        args.budget, tokens, model, device, lsa_cache_pages=0, rest_entry=False, **rerank_keys(args.rerank_codes)
    )
    flashmem.FlashMemoryConfig(**{**cfg.model_dump(), "decode_step": "static", "lsa_fetch_share": args.fetch_share})
    res["config"] = {
        k: getattr(cfg, k)
        for k in ("lsa_top_k", "gpu_cache_limit", "hca_chunk_size", "lsa_cache_pages", "lsa_rerank", "lsa_rerank_codec")
    }
    res["config"]["lsa_fetch_share"] = args.fetch_share
    cache = flashmem.attach(model, cfg)
    try:
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
        t0 = time.perf_counter()
        with torch.no_grad():
            flashmem.prefill(model, cache, ids.to(device), chunk=min(8192, tokens))
        gc.sync(device)
        res["prefill_s"] = time.perf_counter() - t0
        at = tokens
        for mode in ("eager", "static", "graph"):
            if mode == "graph" and device.type != "cuda" and not args.emulate_graphs:
                res[mode] = "n/a (CUDA only)"
                continue
            set_mode(cache, mode, args.fetch_share)
            try:
                res[mode] = mode_section(model, cache, at, args.steps, device, args.emulate_graphs)
            except Exception as exc:  # recorded; the other modes still run
                res[mode] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(-4)}
            at += args.steps + 8
        res["max_memory_allocated"] = gc.peak_bytes(device)
        dyn_ms = res["dynamic"]["decode_ms_median"]
        res["speed_vs_dynamic"] = {
            m: dyn_ms / res[m]["decode_ms_median"]
            for m in ("eager", "static", "graph")
            if isinstance(res[m], dict) and "decode_ms_median" in res[m]
        }
    finally:
        cache.close()
    return res


def rerank_keys(codes: bool) -> dict[str, Any]:
    """The re-rank both modes run: none, or (--rerank-codes) the recipe's 4x candidates scored by
    their int4 codes held on the device, with no candidate floor (its codes would take the budget)."""
    if not codes:
        return {"lsa_rerank": 1}
    return {"lsa_rerank": 4, "lsa_rerank_codec": "int4", "lsa_rerank_on_device": True, "lsa_rerank_min_pages": 0}


def exactness(device: torch.device, emulate: bool = False, codes: bool = False) -> dict[str, Any]:
    """eager, static and graphed static on one token stream, fp32 on the device: max |logit diff|."""
    model = gc.build_llama(gc.SMOKE, 2, torch.float32, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    ids = torch.randint(0, model.config.vocab_size, (1, 600), generator=torch.Generator().manual_seed(3)).to(device)
    cfg = dict(
        gc.SMALL, use_summaries=False, lsa_top_k=6, lsa_page_tokens=4, prefill_exact_tokens=0,
        cold_store="memory", working_set_codec="int8", **rerank_keys(codes),
    )  # fmt: skip
    out: dict[str, Any] = {}
    got = {}
    for name in ("eager", "static", "graph"):
        if name == "graph" and device.type != "cuda" and not emulate:
            continue
        cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**cfg, decode_step=name))
        try:
            with emulated_graphs(emulate and name == "graph"):
                got[name] = gc.decode_logits(model, cache, ids, 60)
            if name == "graph":
                rep = cache.memory_report()
                out["graph_replays"] = rep["static_graph_replays"]
                out["graph_failures"] = rep["static_graph_failures"]
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        finally:
            cache.close()
    for name in ("static", "graph"):
        if name in got:
            out[f"{name}_vs_eager_max_abs_diff"] = float((got[name] - got["eager"]).abs().max())
    return out


def guarded(name: str, out: dict[str, Any], fn: Callable[[], Any]) -> None:
    anatomy.guarded(name, out, fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU in seconds)")
    ap.add_argument("--lengths", default=None, help="context lengths (default 32768,131072; smoke 512)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; smoke 2)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per mode (default 40)")
    ap.add_argument("--budget", type=float, default=1 / 16)
    ap.add_argument("--fetch-share", type=float, default=None, help="lsa_fetch_share (default: every page)")
    ap.add_argument(
        "--rerank-codes", action="store_true",
        help="both modes re-ranked by the candidates' int4 codes held on the device (default: lsa_rerank 1)",
    )  # fmt: skip
    ap.add_argument(
        "--emulate-graphs", action="store_true",
        help="off CUDA: run the graph mode's bookkeeping with each capture and replay a plain call (a test)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here; allowed: --device cpu (with --smoke)", file=sys.stderr)
        return 2
    lengths = [int(x) for x in (args.lengths or ("512" if args.smoke else "32768,131072")).split(",")]
    layers = args.layers or (2 if args.smoke else 4)
    if args.smoke:
        args.budget = max(args.budget, 0.5)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as gpu_check: cuDNN plans every new length
    out: dict[str, Any] = {
        "label": "measured on this device",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": layers,
        "budget": args.budget,
        "rerank_codes": args.rerank_codes,
    }
    try:
        import cupy  # noqa: F401

        out["cupy"] = True
    except ImportError:
        out["cupy"] = False
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def write() -> None:  # after every section: a kill leaves what finished
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)

    guarded("exactness", out, lambda: exactness(device, args.emulate_graphs, args.rerank_codes))
    write()
    model = gc.build_llama(gc.SMOKE if args.smoke else gc.LLAMA_8B, layers, torch.bfloat16, device)
    for n in lengths:
        guarded(f"tokens_{n}", out, lambda n=n: length_section(model, n, args, device))
        write()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
