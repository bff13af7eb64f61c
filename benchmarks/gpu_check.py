"""The GPU check of issue 27, one command (at most ~8 minutes on one H100/H200):

    python benchmarks/gpu_check.py --out results/gpu_check_h200.json
    python benchmarks/gpu_check.py --device cpu --smoke --out /tmp/gpu_check_smoke.json   # CI, seconds

1. **Exactness on the device.** A tiny random Llama (fp32, TF32 off) with configs that keep
   every token exact (every block / every page selected; the re-rank and prefetch on) gives
   DynamicCache's logits within 1e-3 over a prompt and decode steps; so does the first with
   every decode step's keys attended in runs of 5 tokens merged by their log-sum-exp
   (`blocks_in_runs`: at real sizes a step goes in runs past 64 MiB of keys and values).
2. **Decode at 32K and 128K** on a random-weight Llama with Llama-3.1-8B's attention
   geometry (hidden 4096, 32 heads, 8 KV heads x 128, MLP 14336, vocab 128256, bf16) and
   `--layers` layers (4): decode ms per step for DynamicCache in HBM and for flashmem (the
   recipe at `--budget`, cold tier `memory` in host RAM, prefetch on; on CUDA the re-rank
   scores its candidates on the host, `BlockReader.host_ranking`), the bytes across the link
   per step and their ratio to the pages the step newly attends (`cache.traffic_report()`
   when the cache has it, else "n/a"), and `torch.cuda.max_memory_allocated`.
   - DynamicCache is filled directly with random K/V of the length (`cache.update`, seconds;
     decode cost does not depend on the values), then decoded.
   - flashmem's prompt goes through the model (`flashmem.prefill`, model-level chunks of
     `--prefill-chunk` tokens), as a user's would, and is timed too: the cache's tiers, index
     and cold blocks are built only that way.
   - The layer profile (`lsa_layer_shares: profile`) needs a tokenizer and text, so the
     random model splits pages evenly (`lsa_layer_shares: null`).
   Beside the recipe, at the shortest length and after every length (so it cannot take the
   recipe's time), flashmem with `lsa_rerank_codec: int4, lsa_rerank_on_device: true`: the
   re-rank's candidate codes held on the device, only new candidates' codes crossing the link;
   its decode ms, h2d bytes per step and the model's prediction (on CUDA; `--device-rerank`
   elsewhere). The recipe at 128K and 1/16 may already hold its codes so (recipe.DEVICE_RERANK).
   On CUDA also transformers' offloaded cache (`DynamicCache(offloading=True)`, filled the
   same way). Before the lengths, the model's constants are measured: a device copy, host to
   device from pinned and from pageable memory, device to host pinned (1 GiB each).
3. **The hardware model's prediction** (flashmem.sizing.hardware, the same module as
   `flashmem estimate --hardware`) beside each measured figure: the device is read from
   `torch.cuda.get_device_name` (H100, H200, A100, L4) or given with --hardware. DynamicCache
   is predicted with 3 passes over its K/V per step (its torch.cat reads and writes the cache,
   attention reads it), beside the ideal 1 pass.

Every section catches its own failure, records it in the JSON and goes on; lengths are
skipped when the time left (`--time-limit`) would not cover them. `torch.cuda.synchronize`
marks only the timing boundaries. Results go to `--out` (JSON). Run it on the lent GPU as
docs/accelerator.md says, and commit the JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
from functools import partial
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for sub in ("src", "evaluation"):  # runs from a checkout without `pip install -e .` (the GPU machine)
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)

import flashmem  # noqa: E402
from flashmem.errors import FlashMemError  # noqa: E402
from flashmem.sizing import hardware as hwm  # noqa: E402

# Llama-3.1-8B's geometry (config.json on the Hub), the layer count chosen per run
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    rope_theta=500000.0,
)
# --smoke: the same shape of run, small enough for a CPU in seconds
SMOKE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    rope_theta=10000.0,
)
# every token exact: a small window, so blocks seal and the cold tier is used, and every
# block (or page) selected (tests/test_cache.py's ALL_EXACT)
SMALL = dict(
    gpu_cache_limit=16, sink_tokens=2, hca_chunk_size=16, csa_chunk_size=4, csa_band_tokens=32, prefill_chunk=37
)
EXACT_CONFIGS: dict[str, dict[str, Any]] = {
    "blocks": dict(SMALL, lsa_keep_ratio=1.0),
    "pages_rerank_prefetch": dict(
        SMALL,
        lsa_keep_ratio=1.0,
        lsa_page_tokens=4,
        lsa_scorer="mean_key",
        lsa_rerank=4,
        use_summaries=False,
        cold_store="memory",
        prefetch_threads=2,
    ),
}
EXACT_TOL = 1e-3
# exactness configs whose decode steps attend their keys in runs of RUN_TOKENS (cache/assembly.py,
# `Assembly._attend_in_runs`; at real sizes only past DECODE_KV_BYTES_ACCELERATOR, 64 MiB): the
# runs' log-sum-exp merge on the device's own attention path
IN_RUNS = {"blocks_in_runs": "blocks"}
RUN_TOKENS = 5


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_kw(model: Any) -> str:
    """The forward's name for the cache: `cache` in transformers 5.24, `past_key_values` before."""
    params = inspect.signature(model.model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def build_llama(dims: dict[str, Any], layers: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A random-weight Llama built on `device` in `dtype` (no CPU copy of the weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=1 << 18, **dims)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def decode_logits(model: Any, cache: Any, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Prompt then `steps` greedy-free decode steps on a fixed token stream -> [b, steps+1, vocab]."""
    kw = cache_kw(model)
    outs = []
    with torch.no_grad():
        out = model(ids, use_cache=True, **{kw: cache})
        outs.append(out.logits[:, -1].float())
        tok = torch.full((ids.shape[0], 1), 5, device=ids.device)
        for _ in range(steps):
            out = model(tok, use_cache=True, **{kw: cache})
            outs.append(out.logits[:, -1].float())
            tok = (tok * 7 + 3) % model.config.vocab_size
    return torch.stack(outs, 1)


def check_exactness(device: torch.device, prompt: int = 200, steps: int = 32) -> dict[str, Any]:
    """flashmem with every token exact equals DynamicCache (fp32, TF32 off)."""
    from transformers import DynamicCache

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dims = dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128
    )
    from flashmem.cache import assembly

    out: dict[str, Any] = {"tolerance": EXACT_TOL}
    bounds = assembly.DECODE_KV_BYTES, assembly.DECODE_KV_BYTES_ACCELERATOR
    run_bytes = 2 * dims["num_key_value_heads"] * dims["head_dim"] * 4 * RUN_TOKENS  # K and V, fp32, one row
    for name, kw in [*EXACT_CONFIGS.items(), *((n, EXACT_CONFIGS[base]) for n, base in IN_RUNS.items())]:
        try:
            model = build_llama(dims, 2, torch.float32, device)
            ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(1)).to(device)
            ref = decode_logits(model, DynamicCache(config=model.config), ids, steps)
            cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**kw))
            if name in IN_RUNS:
                assembly.DECODE_KV_BYTES = assembly.DECODE_KV_BYTES_ACCELERATOR = run_bytes
            try:
                got = decode_logits(model, cache, ids, steps)
                report = cache.memory_report()
            finally:
                assembly.DECODE_KV_BYTES, assembly.DECODE_KV_BYTES_ACCELERATOR = bounds
                cache.close()
            diff = float((got - ref).abs().max())
            out[name] = {
                "max_abs_diff": diff,
                "ok": diff <= EXACT_TOL,
                "sealed_blocks": report.get("sealed_blocks"),
                "cold_bytes": report.get("cold_bytes"),
            }
        except Exception as exc:  # recorded, the check goes on
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(-3)}
    out["ok"] = all(v.get("ok") for k, v in out.items() if isinstance(v, dict))
    return out


def _rate(fn: Any, nbytes: int, reps: int, device: torch.device) -> float:
    """Bytes per second of `fn()` moving `nbytes`, median of `reps` after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def measure_constants(device: torch.device, nbytes: int, hw: hwm.Hardware) -> dict[str, Any]:
    """The model's bandwidth constants, measured: a device copy (bytes read + written, as
    KINDS.md counts it), host to device from pinned and from pageable memory (transformers'
    offloaded cache copies pageable tensors), device to host pinned. CPU: the copy alone."""
    out: dict[str, Any] = {
        "bytes": nbytes,
        "model": {"hbm_bytes_per_s": hw.hbm_bytes_per_s, "link": hw.link_bytes_per_s},
    }
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    out["device_copy_bytes_per_s"] = _rate(partial(b.copy_, a), 2 * nbytes, 5, device)
    if device.type != "cuda":
        out["link"] = "n/a (no CUDA device)"
        return out
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    out["h2d_pinned_bytes_per_s"] = _rate(partial(a.copy_, pinned, non_blocking=True), nbytes, 5, device)
    out["h2d_pageable_bytes_per_s"] = _rate(partial(a.copy_, pageable), nbytes, 3, device)
    out["d2h_pinned_bytes_per_s"] = _rate(partial(pinned.copy_, a, non_blocking=True), nbytes, 5, device)
    del a, b, pinned, pageable
    torch.cuda.empty_cache()
    return out


def hardware_for(device: torch.device, given: str | None) -> hwm.Hardware:
    if given:
        return hwm.get_hardware(given)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        for key in ("H200", "H100", "A100", "L4"):
            if key in name:
                return hwm.get_hardware(key.lower())
    return hwm.get_hardware("h200")  # CPU smoke: the model is exercised, its figures are for an H200


def peak_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed_decode(model: Any, cache: Any, start: int, steps: int, warmup: int, device: torch.device) -> list[float]:
    """ms per decode step (one random token each), `warmup` untimed steps first."""
    kw = cache_kw(model)
    gen = torch.Generator().manual_seed(start)
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            tok = torch.randint(0, model.config.vocab_size, (1, 1), generator=gen).to(device)
            sync(device)
            t0 = time.perf_counter()
            model(tok, use_cache=True, **{kw: cache})
            sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def fill_dynamic(model: Any, tokens: int, device: torch.device) -> Any:
    """DynamicCache holding `tokens` random K/V per layer (decode cost does not depend on the values)."""
    from transformers import DynamicCache

    c = model.config
    cache = DynamicCache(config=c)
    g = torch.Generator(device=device).manual_seed(0)
    for layer in range(c.num_hidden_layers):
        shape = (1, c.num_key_value_heads, tokens, c.head_dim)
        k = torch.randn(shape, generator=g, device=device, dtype=model.dtype)
        v = torch.randn(shape, generator=g, device=device, dtype=model.dtype)
        cache.update(k, v, layer)
    return cache


def traffic_of(cache: Any) -> dict[str, Any] | None:
    fn = getattr(cache, "traffic_report", None)
    if fn is None:
        return None
    try:
        return dict(fn())
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def predictions(hw: hwm.Hardware, model: Any, tokens: int, cfg: Any, traffic: dict[str, Any] | None) -> dict[str, Any]:
    """The hardware model's figures for this run's own model, batch 1."""
    from flashmem.sizing.calculator import estimate

    c = model.config
    arch = hwm.arch_from_config(c.to_dict())
    eb = torch.tensor([], dtype=model.dtype).element_size()
    kv_tok = c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * eb
    cost = hwm.model_cost(
        "gpu-check", layers=c.num_hidden_layers, kv_bytes_per_token=kv_tok, dtype_bytes=eb, q_width=0, arch=arch
    )
    a = hwm.Assumptions()
    dyn = hwm.full_row(hw, cost, tokens, 1, a, kv_passes=3, method="DynamicCache")
    off = hwm.offloaded_row(hw, cost, tokens, 1, a, None)
    ideal = hwm.full_row(hw, cost, tokens, 1, a)
    dtype = {4: "float32", 2: "bfloat16"}[eb]
    est = estimate(
        None, tokens=tokens, layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
        dtype=dtype, config=cfg,
    )  # fmt: skip
    flash = est.flashmem
    assert flash is not None
    group = c.num_attention_heads // c.num_key_value_heads  # query heads per KV head: the re-rank's FLOPs
    pred = hwm.predicted_traffic(flash, cfg, tokens, a, c.head_dim, eb, group)
    fm = hwm.flashmem_row(hw, cost, tokens, 1, a, pred, flash.cold_bytes, None)
    # the roofline alone (the host's operator launches not counted) and flashmem's upper bound
    # (its launches added to the device's time: it waits on the device within every layer)
    roof = hwm.Assumptions(dispatch="off")
    serial = hwm.Assumptions(dispatch="serial")
    out: dict[str, Any] = {
        "label": "modelled, not measured",
        "hardware": hw.key,
        "weight_bytes": cost.weight_bytes,
        "dynamic_decode_ms": dyn.step_s * 1e3,
        "ideal_full_decode_ms": ideal.step_s * 1e3,
        "offloaded_decode_ms": off.step_s * 1e3,
        "dynamic_roofline_ms": hwm.full_row(hw, cost, tokens, 1, roof, kv_passes=3).step_s * 1e3,
        "ideal_full_roofline_ms": hwm.full_row(hw, cost, tokens, 1, roof).step_s * 1e3,
        "flashmem_roofline_ms": hwm.flashmem_row(hw, cost, tokens, 1, roof, pred, flash.cold_bytes, None).step_s * 1e3,
        "flashmem_serial_dispatch_ms": hwm.flashmem_row(
            hw, cost, tokens, 1, serial, pred, flash.cold_bytes, None
        ).step_s
        * 1e3,
        "dynamic_peak_bytes": cost.weight_bytes + tokens * kv_tok + tokens * kv_tok / c.num_hidden_layers,
        "flashmem_decode_ms": fm.step_s * 1e3,
        "flashmem_bound": fm.bound,
        "flashmem_link_bytes_per_step": pred.link_bytes,
        "flashmem_link_parts": pred.parts,
        "flashmem_held_code_bytes": pred.held_code_bytes,
        "flashmem_host_flops_per_step": pred.host_flops,
        # HBM per step: the tiers read plus what the step writes and reads back to attend (its
        # K/V buffer, the index converted); beside the run's counted device_copy_bytes
        "flashmem_device_read_bytes_per_step": pred.device_read_bytes,
        "flashmem_assembly_bytes_per_step": pred.assembly_bytes,
        "flashmem_device_resident_bytes": flash.device_resident_bytes,
        "flashmem_peak_bytes": cost.weight_bytes + flash.prompt_peak_bytes,
        "prefill_s": fm.prefill_s,
        "prefill_bound": fm.prefill_bound,
    }
    if traffic and "per_decode_step_median" in traffic:
        try:
            hwm.check_traffic(traffic)
            counted = hwm.counted_traffic(traffic, flash.device_resident_bytes, flash.prompt_kv_bytes, "this run")
            row = hwm.flashmem_row(hw, cost, tokens, 1, a, counted, flash.cold_bytes, None)
            out["flashmem_decode_ms_from_counted_traffic"] = row.step_s * 1e3
        except Exception as exc:
            out["counted_traffic_error"] = f"{type(exc).__name__}: {exc}"
    return out


def recipe_config(budget: float, tokens: int, model: Any, device: torch.device, **overrides: Any) -> Any:
    """The recipe at `budget` after `tokens`, cold tier in host memory, prefetch on, pages split
    evenly; off the CPU with the prompt streamed in the chunks `flashmem.attach(model)` picks
    there (`ACCELERATOR_PREFILL_CHUNK`, 4,096 tokens: the 512 of a CPU read every earlier block
    back over the link 8x as often, docs/accelerator.md)."""
    from flashmem.cache.attach import ACCELERATOR_PREFILL_CHUNK

    if device.type != "cpu":
        overrides = {"prefill_chunk": ACCELERATOR_PREFILL_CHUNK, **overrides}
    return flashmem.FlashMemoryConfig.for_budget(
        budget, tokens, model, lsa_layer_shares=None, cold_store="memory", prefetch_threads=2, **overrides
    )


def run_length(
    model: Any, tokens: int, args: argparse.Namespace, device: torch.device, hw: hwm.Hardware, deadline: float
) -> dict[str, Any]:
    res: dict[str, Any] = {"tokens": tokens}
    # DynamicCache in HBM, filled directly
    try:
        model.set_attn_implementation("sdpa")
        reset_peak(device)
        t0 = time.perf_counter()
        cache = fill_dynamic(model, tokens, device)
        sync(device)
        fill_s = time.perf_counter() - t0
        ms = timed_decode(model, cache, tokens, args.steps, 2, device)
        res["dynamic"] = {
            "fill_s": fill_s,
            "decode_ms_median": statistics.median(ms),
            "decode_ms": ms,
            "max_memory_allocated": peak_bytes(device),
        }
        del cache
    except Exception as exc:
        res["dynamic"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(-3)}
    # transformers' offloaded cache (CUDA only: it copies on a CUDA stream), filled directly
    if device.type == "cuda":
        try:
            from transformers import DynamicCache

            reset_peak(device)
            c = model.config
            off = DynamicCache(config=c, offloading=True)
            g = torch.Generator(device=device).manual_seed(0)
            shape = (1, c.num_key_value_heads, tokens, c.head_dim)
            for layer in range(c.num_hidden_layers):
                k = torch.randn(shape, generator=g, device=device, dtype=model.dtype)
                off.update(k, torch.randn(shape, generator=g, device=device, dtype=model.dtype), layer)
            del k
            ms = timed_decode(model, off, tokens, max(4, args.steps // 4), 1, device)
            res["offloaded"] = {
                "decode_ms_median": statistics.median(ms),
                "decode_ms": ms,
                "max_memory_allocated": peak_bytes(device),
            }
            del off
        except Exception as exc:
            res["offloaded"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(-3)}
    else:
        res["offloaded"] = "n/a (transformers offloads on CUDA only)"
    # flashmem: the recipe, cold tier in host memory, prefetch on (a smoke run's 256-512 tokens
    # hold no page at 1/16: at 1/2 the recipe selects pages, so ranking and the working set run)
    cfg = recipe_config(max(args.budget, 0.5) if args.smoke else args.budget, tokens, model, device)
    try:
        res["prediction"] = predictions(hw, model, tokens, cfg, None)
    except Exception as exc:
        res["prediction"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(-3)}
    left = deadline - time.perf_counter()
    # the last length's prefill, scaled linearly and doubled, must fit in what is left
    last = getattr(args, "last_prefill", None)
    guess = 2 * last[1] * tokens / last[0] if last else 0.0
    if left < max(args.min_flashmem_s, guess):
        res["flashmem"] = {"skipped": f"time: {left:.0f} s left of --time-limit, about {guess:.0f} s needed"}
        return res
    res["flashmem"] = run_flashmem(model, tokens, cfg, args, device, hw)
    pred = res["flashmem"].pop("prediction", None)
    if isinstance(pred, dict) and "error" not in pred:  # with the run's counted traffic beside it
        res["prediction"] = pred
    return res


# The variant beside the recipe (CUDA; --device-rerank on a CPU): the re-rank's candidates
# scored by int4 codes held on the device (cache/rerank_codes.py DeviceCandidates), only new
# candidates' codes crossing the link. Run after every length, at the shortest one only, so
# that it cannot take the recipe's time.
DEVICE_RERANK = {"lsa_rerank_codec": "int4", "lsa_rerank_on_device": True}


def run_device_rerank(
    model: Any, tokens: int, args: argparse.Namespace, device: torch.device, hw: hwm.Hardware, deadline: float
) -> dict[str, Any]:
    """flashmem with DEVICE_RERANK laid over the recipe at `tokens`: decode ms, h2d bytes per step.
    A smoke run's 256 tokens leave no page beside the candidates' codes at 1/16 (budget_config
    refuses that), so it runs at 3/4 of the cache; a refusal at real sizes is recorded as skipped."""
    budget = max(args.budget, 0.75) if args.smoke else args.budget
    try:
        cfg = recipe_config(budget, tokens, model, device, **DEVICE_RERANK)
    except FlashMemError as exc:
        return {"tokens": tokens, "budget": budget, "skipped": str(exc)}
    last = getattr(args, "last_prefill", None)
    guess = 2 * last[1] * tokens / last[0] if last else 0.0
    left = deadline - time.perf_counter()
    if left < max(args.min_flashmem_s, guess):
        return {"tokens": tokens, "skipped": f"time: {left:.0f} s left of --time-limit, about {guess:.0f} s needed"}
    return {
        "tokens": tokens,
        "budget": budget,
        "overrides": dict(DEVICE_RERANK),
        **run_flashmem(model, tokens, cfg, args, device, hw),
    }


def run_flashmem(
    model: Any, tokens: int, cfg: Any, args: argparse.Namespace, device: torch.device, hw: hwm.Hardware
) -> dict[str, Any]:
    """One flashmem run under `cfg`: the prompt through the model, then timed decode steps, its
    traffic and the hardware model's prediction for the same config."""
    out: dict[str, Any]
    cache = None
    try:
        reset_peak(device)
        cache = flashmem.attach(model, cfg)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
        ids = ids.to(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            flashmem.prefill(model, cache, ids, chunk=args.prefill_chunk)
        sync(device)
        prefill_s = time.perf_counter() - t0
        args.last_prefill = (tokens, prefill_s)
        prefill_peak = peak_bytes(device)
        ms = timed_decode(model, cache, tokens, args.steps, 2, device)
        traffic = traffic_of(cache)
        report = cache.memory_report()
        reuse = reuse_decode(model, cache, cfg, tokens + args.steps + 2, args, device, hw)
        keys = (
            "lsa_top_k",
            "gpu_cache_limit",
            "lsa_rerank",
            "prefill_chunk",
            "lsa_rerank_codec",
            "lsa_rerank_on_device",
            "lsa_cache_pages",
        )
        out = {
            "config": {k: getattr(cfg, k) for k in keys},
            "prefill_s": prefill_s,
            "prefill_max_memory_allocated": prefill_peak,
            "decode_ms_median": statistics.median(ms),
            "decode_ms": ms,
            "max_memory_allocated": peak_bytes(device),
            "device_resident_bytes": report.get("device_resident_bytes"),
            "cold_bytes": report.get("cold_bytes"),
            "link_bytes_per_step": (
                traffic["per_decode_step_median"]["h2d_bytes"]
                if traffic and "per_decode_step_median" in traffic
                else "n/a"
            ),
            # the link's bytes over the bytes of the pages a step newly attends (1.0: only those)
            "h2d_over_new_pages": traffic.get("h2d_over_new_pages_median", "n/a") if traffic else "n/a",
            "traffic_report": traffic if traffic is not None else "n/a",
            "select_every": reuse,
        }
        try:
            out["prediction"] = predictions(hw, model, tokens, cfg, traffic)
        except Exception as exc:
            out["prediction"] = {"error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(-3)}
    finally:
        if cache is not None:
            cache.close()
        model.set_attn_implementation("sdpa")
    return out


def reuse_decode(
    model: Any, cache: Any, cfg: Any, start: int, args: argparse.Namespace, device: torch.device, hw: hwm.Hardware
) -> Any:
    """The same cache's next decode steps with `lsa_select_every` N (--select-every): one step in
    N ranks and gathers, the others attend its pages (docs/accelerator.md, "A selection that
    serves several steps"); no second prompt. 'n/a' with N <= 1."""
    every = int(args.select_every)
    if every <= 1:
        return "n/a"
    for layer in cache.flash_layers:
        layer.cfg = layer.cfg.model_copy(update={"lsa_select_every": every})
    # the mean, not the median: one step in N selects and costs more
    ms = timed_decode(model, cache, start, max(args.steps, 2 * every), 2, device)
    out: dict[str, Any] = {"every": every, "decode_ms_mean": statistics.fmean(ms), "decode_ms": ms}
    try:
        pred = predictions(hw, model, start, cfg.model_copy(update={"lsa_select_every": every}), None)
        out["modelled_decode_ms"] = pred.get("flashmem_decode_ms")
    except Exception as exc:
        out["modelled_decode_ms"] = f"{type(exc).__name__}: {exc}"
    return out


def summary_lines(results: dict[str, Any]) -> list[str]:
    lines = [f"exactness: {'ok' if results['exactness'].get('ok') else 'FAILED'}"]
    k = results.get("constants", {})
    rates = {n: v for n, v in k.items() if n.endswith("_bytes_per_s")}
    if rates:
        lines.append(
            "measured: " + ", ".join(f"{n[: -len('_bytes_per_s')]} {v / 1e9:.1f} GB/s" for n, v in rates.items())
        )
    for r in results.get("lengths", []):
        p = r.get("prediction", {})
        d, f = r.get("dynamic", {}), r.get("flashmem", {})

        def ms(x: Any) -> str:
            return f"{x:.3g}" if isinstance(x, int | float) else "n/a"

        o = r.get("offloaded")
        if isinstance(o, dict):
            lines.append(
                f"{r['tokens']:>7} tokens: offloaded {ms(o.get('decode_ms_median'))} ms/step "
                f"(modelled {ms(p.get('offloaded_decode_ms'))})" + (f"; {o['error']}" if "error" in o else "")
            )
        lines.append(
            f"{r['tokens']:>7} tokens: DynamicCache {ms(d.get('decode_ms_median'))} ms/step "
            f"(modelled {ms(p.get('dynamic_decode_ms'))}); flashmem {ms(f.get('decode_ms_median'))} ms/step "
            f"(modelled {ms(p.get('flashmem_decode_ms'))}, {p.get('flashmem_bound', '?')}-bound); link/step "
            f"{f.get('link_bytes_per_step', 'n/a')} (modelled {p.get('flashmem_link_bytes_per_step', 0):.3g}, "
            f"{f.get('h2d_over_new_pages', 'n/a')} x the new pages); "
            f"max_memory_allocated {d.get('max_memory_allocated') or 'n/a'} / {f.get('max_memory_allocated') or 'n/a'} B"
            + (
                f"; select_every {f['select_every']['every']}: {ms(f['select_every'].get('decode_ms_mean'))} ms/step "
                f"(modelled {ms(f['select_every'].get('modelled_decode_ms'))})"
                if isinstance(f.get("select_every"), dict)
                else ""
            )
            + (
                f"; flashmem: {f['error'] if 'error' in f else f.get('skipped')}"
                if "error" in f or "skipped" in f
                else ""
            )
        )
    v = results.get("device_rerank")
    if isinstance(v, dict):
        p = v.get("prediction", {}) if isinstance(v.get("prediction"), dict) else {}

        def num(x: Any) -> str:
            return f"{x:.3g}" if isinstance(x, int | float) else "n/a"

        lines.append(
            f"{v['tokens']:>7} tokens: flashmem, int4 re-rank codes held on the device: "
            f"{num(v.get('decode_ms_median'))} ms/step (modelled {num(p.get('flashmem_decode_ms'))}); h2d/step "
            f"{v.get('link_bytes_per_step', 'n/a')} (modelled {num(p.get('flashmem_link_bytes_per_step'))}); "
            f"max_memory_allocated {v.get('max_memory_allocated') or 'n/a'} B"
            + (f"; {v.get('error') or v.get('skipped')}" if "error" in v or "skipped" in v else "")
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU in seconds): for CI")
    ap.add_argument("--lengths", default=None, help="comma-separated tokens (default 32768,131072; smoke 256,512)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the random model (default 4; smoke 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16; smoke 3)")
    ap.add_argument("--budget", type=float, default=1 / 16, help="flashmem's recipe budget (default 1/16)")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="model-level prefill chunk, tokens")
    ap.add_argument("--hardware", default=None, help="h100|h200|a100|l4 (default: from the device name)")
    ap.add_argument("--time-limit", type=float, default=450.0, help="seconds for the whole check (default 450)")
    ap.add_argument("--min-flashmem-s", type=float, default=None, help="skip a flashmem length with less time left")
    ap.add_argument(
        "--select-every",
        type=int,
        default=4,
        help="after the recipe's timed steps, time as many more with lsa_select_every N (default 4; 1: not run)",
    )
    ap.add_argument(
        "--device-rerank",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run flashmem with int4 re-rank codes held on the device, at the shortest length "
        "(default: on CUDA only)",
    )
    ap.add_argument(
        "--cudnn-sdpa",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="PyTorch's cuDNN attention backend for the model's own attention (DynamicCache's): off by "
        "default, as flashmem's attention leaves it out (cache/sdpa.py): on an H200 with torch 2.11 it "
        "plans each new context length anew, 9-60 ms a call (benchmarks/diagnostics/gpu_step_anatomy.py)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here; allowed: --device cpu (with --smoke)", file=sys.stderr)
        return 2
    smoke = args.smoke
    lengths = [int(x) for x in (args.lengths or ("256,512" if smoke else "32768,131072")).split(",")]
    args.layers = args.layers or (2 if smoke else 4)
    args.steps = args.steps or (3 if smoke else 16)
    args.min_flashmem_s = args.min_flashmem_s if args.min_flashmem_s is not None else (0.0 if smoke else 60.0)
    args.device_rerank = device.type == "cuda" if args.device_rerank is None else args.device_rerank
    if smoke:
        args.prefill_chunk = min(args.prefill_chunk, 256)
    start = time.perf_counter()
    deadline = start + args.time_limit
    torch.manual_seed(0)
    hw = hardware_for(device, args.hardware)
    results: dict[str, Any] = {
        "label": "measured on this device; 'prediction' entries are modelled, not measured",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "smoke": smoke,
        "args": {k: v for k, v in vars(args).items()},
        "hardware_model": hw.key,
        "cudnn_sdpa_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    try:
        import transformers

        results["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass
    results["exactness"] = check_exactness(device, *((120, 8) if smoke else (200, 32)))
    try:
        results["constants"] = measure_constants(device, (16 if smoke else 1024) * 2**20, hw)
    except Exception as exc:
        results["constants"] = {"error": f"{type(exc).__name__}: {exc}"}
    results["lengths"] = []
    try:
        model = build_llama(SMOKE if smoke else LLAMA_8B, args.layers, torch.bfloat16, device)
        for tokens in lengths:
            if time.perf_counter() > deadline:
                results["lengths"].append({"tokens": tokens, "skipped": "time"})
                continue
            results["lengths"].append(run_length(model, tokens, args, device, hw, deadline))
            with open(args.out, "w") as f:  # partial results survive a kill
                json.dump(results, f, indent=2, default=str)
        if args.device_rerank:
            results["device_rerank"] = run_device_rerank(model, min(lengths), args, device, hw, deadline)
    except Exception as exc:
        results["model_error"] = f"{type(exc).__name__}: {exc}"
        results["trace"] = traceback.format_exc(-3)
    results["wall_s"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    for line in summary_lines(results):
        print(line)
    print(f"wrote {args.out} ({results['wall_s']:.1f} s)")
    return 0 if results["exactness"].get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
