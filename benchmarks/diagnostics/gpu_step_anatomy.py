"""Where a decode step's time goes on the GPU: the host's launches, or the device's work.

The first H200 run of `benchmarks/gpu_check.py` (results/gpu_check_h200.json) timed
DynamicCache in HBM at 66-67 ms a step at both 32K and 128K, where reading its weights and
K/V once takes 1-2 ms. A cost that does not grow with the context is the host's. This
separates the two, on the same model as gpu_check (Llama-3.1-8B's attention geometry, 4
layers, bf16):

- the machine: CPU count and model, a pure-Python loop, PyTorch's thread count;
- one launch: µs per eager `add_` on a one-element tensor (the host's floor per operator),
  and per kernel replayed from a CUDA graph (the device's floor);
- DynamicCache at `--tokens`: ms a step eager; under torch.profiler, kernels a step and the
  device's busy time a step (the sum of its kernels' durations), so that the host's share is
  the rest;
- StaticCache, the same step captured in a CUDA graph and replayed: the step with no host
  cost per operator, as vLLM and SGLang run decode;
- flashmem's recipe at `--budget` (gpu_check's config): ms a step eager, kernels a step,
  the device's busy time and the host-device copies and synchronisations a step;
- flashmem's synchronisations in one step, by the Python line that makes them
  (`torch.cuda.set_sync_debug_mode`): where a step that a CUDA graph could capture must not wait;
- DynamicCache again after flashmem's caches have run and closed, and the threads still
  alive then (a background thread holding the GIL would slow every later step).

    python benchmarks/diagnostics/gpu_step_anatomy.py --out results/gpu_step_anatomy_h200.json
    python benchmarks/diagnostics/gpu_step_anatomy.py --device cpu --smoke --out /tmp/anatomy.json

Every section records its own failure and the run goes on. On a CPU the profiler's device
figures are absent and the graph sections are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# benchmarks/ (gpu_check's model and configs) and src/ (a checkout without `pip install -e .`)
for path in (os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "src")):
    if path not in sys.path:
        sys.path.insert(0, path)

import flashmem  # noqa: E402
import gpu_check as gc  # noqa: E402


def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    t0 = time.perf_counter()
    sum(range(10**7))
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "torch_threads": torch.get_num_threads(),
        "python_sum_1e7_ms": (time.perf_counter() - t0) * 1e3,
        "switch_interval_s": sys.getswitchinterval(),
    }


def launch_floor(device: torch.device, n: int = 2000) -> dict[str, Any]:
    """µs per eager one-element add_ (host-bound) and per graph-replayed one (device-bound)."""
    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1)
    gc.sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    gc.sync(device)
    out: dict[str, Any] = {"eager_us_per_launch": (time.perf_counter() - t0) / n * 1e6}
    if device.type != "cuda":
        return out
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(200):
            x.add_(1)
    g.replay()
    gc.sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        g.replay()
    gc.sync(device)
    out["graph_us_per_kernel"] = (time.perf_counter() - t0) / (10 * 200) * 1e6
    return out


def profile_steps(step: Callable[[], Any], steps: int, device: torch.device) -> dict[str, Any]:
    """torch.profiler over `steps` calls of `step`: per step, the wall ms, the kernels launched,
    the device's busy ms (sum of kernel durations), host<->device copies and synchronisations."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    gc.sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        gc.sync(device)
        wall = time.perf_counter() - t0
    kernels = busy_us = 0.0
    copies = syncs = launches = 0
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            busy_us += e.device_time
        elif name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += 1
        elif name.startswith("cudaMemcpy") or name.startswith("cuMemcpy"):
            copies += 1
        elif "Synchronize" in name:
            syncs += 1
    per = float(steps)
    cpu_top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    return {
        "wall_ms_per_step": wall / per * 1e3,
        "device_events_per_step": kernels / per,
        "device_busy_ms_per_step": busy_us / per / 1e3,
        "launch_calls_per_step": launches / per,
        "memcpy_calls_per_step": copies / per,
        "sync_calls_per_step": syncs / per,
        "top_self_cpu": [
            {"name": a.key, "calls_per_step": a.count / per, "self_cpu_ms_per_step": a.self_cpu_time_total / per / 1e3}
            for a in cpu_top
        ],
    }


def token_stream(model: Any, device: torch.device, seed: int) -> Callable[[], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return lambda: torch.randint(0, model.config.vocab_size, (1, 1), generator=gen).to(device)


def dynamic_section(model: Any, tokens: int, steps: int, device: torch.device) -> dict[str, Any]:
    cache = gc.fill_dynamic(model, tokens, device)
    ms = gc.timed_decode(model, cache, tokens, steps, 2, device)
    nxt = token_stream(model, device, 7)
    kw = gc.cache_kw(model)
    with torch.no_grad():
        prof = profile_steps(lambda: model(nxt(), use_cache=True, **{kw: cache}), 3, device)
    return {"decode_ms_median": statistics.median(ms), "decode_ms": ms, "profile": prof}


def static_graph_section(model: Any, tokens: int, steps: int, device: torch.device) -> dict[str, Any]:
    """StaticCache holding `tokens` random K/V; one decode step eager, then captured in a CUDA
    graph and replayed (the position advances in a device tensor, so the graph is reused)."""
    from transformers import StaticCache

    c = model.config
    cache = StaticCache(config=c, max_cache_len=tokens + 4 * steps + 16)
    g = torch.Generator(device=device).manual_seed(0)
    pos = torch.arange(tokens, device=device)
    for layer in range(c.num_hidden_layers):
        shape = (1, c.num_key_value_heads, tokens, c.head_dim)
        k = torch.randn(shape, generator=g, device=device, dtype=model.dtype)
        v = torch.randn(shape, generator=g, device=device, dtype=model.dtype)
        cache.update(k, v, layer, {"cache_position": pos})
    kw = gc.cache_kw(model)
    tok = torch.zeros((1, 1), dtype=torch.long, device=device)
    cpos = torch.tensor([tokens], device=device)

    def step() -> Any:
        return model(tok, cache_position=cpos, position_ids=cpos.view(1, 1), use_cache=True, **{kw: cache})

    out: dict[str, Any] = {}
    with torch.no_grad():
        for _ in range(3):
            step()
        gc.sync(device)
        t = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            gc.sync(device)
            t.append((time.perf_counter() - t0) * 1e3)
        out["eager_ms_median"] = statistics.median(t)
        if device.type != "cuda":
            return out
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        gc.sync(device)
        t = []
        for _ in range(steps):
            t0 = time.perf_counter()
            graph.replay()
            gc.sync(device)
            t.append((time.perf_counter() - t0) * 1e3)
        out["graph_ms_median"] = statistics.median(t)
        out["graph_ms"] = t
    return out


def flashmem_section(model: Any, tokens: int, budget: float, steps: int, device: torch.device) -> dict[str, Any]:
    cfg = gc.recipe_config(budget, tokens, model, device)
    cache = flashmem.attach(model, cfg)
    try:
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            flashmem.prefill(model, cache, ids.to(device), chunk=min(8192, tokens))
        ms = gc.timed_decode(model, cache, tokens, steps, 2, device)
        nxt = token_stream(model, device, 9)
        kw = gc.cache_kw(model)
        with torch.no_grad():
            prof = profile_steps(lambda: model(nxt(), use_cache=True, **{kw: cache}), 3, device)
            syncs = sync_points(lambda: model(nxt(), use_cache=True, **{kw: cache}), device)
    finally:
        cache.close()
    return {
        "config": {"lsa_top_k": cfg.lsa_top_k, "gpu_cache_limit": cfg.gpu_cache_limit, "lsa_rerank": cfg.lsa_rerank},
        "decode_ms_median": statistics.median(ms),
        "decode_ms": ms,
        "profile": prof,
        "sync_points": syncs,
    }


def sync_points(step: Callable[[], Any], device: torch.device) -> dict[str, Any] | str:
    """Where one step makes the host wait for the device: PyTorch's sync debug mode warns at
    every synchronising call (a value read, a copy to pageable memory, a nonzero), and the
    warning's location is the Python line that made it. -> {"file:line": count} and the total;
    "n/a" off CUDA. The lines are where a captured step must not wait."""
    if device.type != "cuda":
        return "n/a (CUDA only)"
    import warnings

    gc.sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where: dict[str, int] = {}
    for w in caught:
        if "synchroniz" not in str(w.message).lower():
            continue
        key = f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    return {"total": sum(where.values()), "by_line": dict(sorted(where.items(), key=lambda kv: -kv[1]))}


def sdpa_backends(device: torch.device, calls: int = 20) -> dict[str, Any]:
    """ms per decode-shaped SDPA call (q 1 x 32 heads, K/V 8 heads x L x 128, bf16, a float
    mask as flashmem's assembly passes), per backend: L new at every call (as in decode, where
    the context grows) and L repeated. A backend that plans per shape pays at every new L."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    out: dict[str, Any] = {}
    for name in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name)
        res: dict[str, Any] = {}
        for mode in ("new_length", "same_length"):
            try:
                t = []
                for i in range(calls + 2):
                    L = 8192 + (16 * i if mode == "new_length" else 0)
                    q = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16)
                    k = torch.randn(1, 8, L, 128, device=device, dtype=torch.bfloat16)
                    v = torch.randn_like(k)
                    mask = None if name == "FLASH_ATTENTION" else torch.zeros(1, 32, 1, L, device=device, dtype=q.dtype)
                    gc.sync(device)
                    t0 = time.perf_counter()
                    with sdpa_kernel([backend]):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    gc.sync(device)
                    if i >= 2:
                        t.append((time.perf_counter() - t0) * 1e3)
                res[mode + "_ms_median"] = statistics.median(t)
            except Exception as exc:
                res[mode] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out[name.lower()] = res
    return out


def guarded(name: str, out: dict[str, Any], fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as exc:  # recorded; the run goes on
        out[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(-4)}
    if isinstance(out[name], dict):
        out[name]["section_s"] = time.perf_counter() - t0
    print(f"{name}: {json.dumps(out[name], default=str)[:600]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU in seconds)")
    ap.add_argument("--tokens", type=int, default=None, help="context length (default 32768; smoke 512)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; smoke 2)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per section (default 10)")
    ap.add_argument("--budget", type=float, default=1 / 16, help="flashmem's budget (default 1/16)")
    ap.add_argument(
        "--no-cudnn-sdpa", action="store_true", help="after the SDPA section, turn off PyTorch's cuDNN attention"
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here; allowed: --device cpu (with --smoke)", file=sys.stderr)
        return 2
    tokens = args.tokens or (512 if args.smoke else 32768)
    layers = args.layers or (2 if args.smoke else 4)
    budget = max(args.budget, 0.5) if args.smoke else args.budget
    out: dict[str, Any] = {
        "label": "measured on this device",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens": tokens,
        "layers": layers,
        "budget": budget,
    }
    guarded("machine", out, machine)
    guarded("launch_floor", out, lambda: launch_floor(device))
    guarded("sdpa_backends", out, lambda: sdpa_backends(device))
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    out["cudnn_sdpa_enabled"] = torch.backends.cuda.cudnn_sdp_enabled()
    model = gc.build_llama(gc.SMOKE if args.smoke else gc.LLAMA_8B, layers, torch.bfloat16, device)
    guarded("dynamic", out, lambda: dynamic_section(model, tokens, args.steps, device))
    guarded("static_graph", out, lambda: static_graph_section(model, tokens, args.steps, device))
    guarded("flashmem", out, lambda: flashmem_section(model, tokens, budget, args.steps, device))
    guarded("dynamic_after", out, lambda: dynamic_section(model, tokens, args.steps, device))
    out["threads_alive"] = [t.name for t in threading.enumerate()]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
