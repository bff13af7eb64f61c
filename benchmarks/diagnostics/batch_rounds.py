"""Where a batched decode round's time goes, in process (no HTTP), one torch thread:

    python benchmarks/diagnostics/batch_rounds.py --clients 8 --max-tokens 24 --out r.json

1. `e2e`: the engine (configs/cpu-small.yaml, SmolLM2) given `--clients` chat requests at
   once (serve_load.py's --mode batch prompts, greedy), driven by `Engine.step` until all
   finish, for the unbatched engine (max_batch 1, restore on the worker: serve_load's
   "unbatched" server), the batched engine with one forward per prompt chunk
   (pack_prefill=False) and the batched engine as served: generated tokens / wall and CPU
   seconds, TTFT, inter-token p50/p99, and the CPU seconds in prompt chunks, batched
   forwards and single-sequence decode steps;
2. `round`: `--rounds` decode rounds with every sequence decoding (after the prompts),
   under cProfile, batched and with max_batch 1: CPU ms per round and its parts (the
   linear layers, the rows' attention and cache bookkeeping, the per-row layer steps of
   rows with sealed blocks, the cache updates, the engine's sampling and emitting); with
   `--round-context N` the prompts are N-token documents (sealed blocks: every row
   selects its own pages) instead of the short chat prompts;
3. `ablation`: `--rounds` x 3 decode rounds of the chat prompts, EOS ignored (every row
   decodes throughout), not profiled: CPU ms per round batched, then with the short rows'
   attention (`batched._attend_short`) cut down to each layer's append, then to nothing
   (wrong tokens, the same shapes): what the rows' attention and bookkeeping cost, and
   the round with none of it; and the unbatched engine's ms per token the same way;
4. `forward`: the plain model forward (a DynamicCache, no flashmem) of 1 token per row at
   batch 1 and at batch `--clients`, and of a `--clients` x 40-token prompt packed in one
   row: CPU ms, the bound batching meets on this CPU.
Every engine's answers are compared (`answers_identical`). `--ablation-only` runs part 3 alone.
`--dtype bfloat16` (or float16): the model in that dtype and, without `--config`, the recipe
sized for its bytes, as `flashmem serve --dtype` runs it.

`--shared-ab` alone: the same alternation (after `--warm-rounds` rounds, so that chat rows pass
their first sealed block) between rows that attend every sealed page joining the batch's shared
SDPA (`batched._short_decode`) and such rows running their own layer steps (before stop 51).

`--layout-ab` alone: the same alternation between the linear weights stored [in, out] and
[out, in] (`flashmem.models.weight_layout`), or the `--layouts` given (e.g. onednn,in_major:
the warm rounds run in the first): the batched round and the unbatched token.

`--attend-ab FILE` alone: the same alternation, batched rounds only, between this tree's short
rows' shared attention (`batched._attend_short`) and FILE's (another tree's
src/flashmem/cache/batched.py, e.g. from `git archive`), in `--ab-blocks` blocks each.

`--every-page-ab` alone: the `--round-context` documents (1000 tokens unless given) decoded
batched and with max_batch 1, EOS ignored, in blocks of `--rounds` rounds that alternate
(twice each) between layers that attend every sealed page unranked when the budget covers
them (`tiered_attention.selects_every_page`, stop 48) and layers that rank them anyway (as
before): CPU ms per round and per token, not profiled.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from flashmem.cli.run_cmd import sized_default_config  # noqa: E402
from flashmem.config import FlashMemoryConfig  # noqa: E402
from flashmem.models.loading import load_model  # noqa: E402
from flashmem.serve import engine as engine_mod  # noqa: E402
from flashmem.serve.app import chat_prompt_ids  # noqa: E402
from flashmem.serve.engine import Engine, Sampling, Sequence  # noqa: E402
from flashmem_eval.benchkit import cpu_name  # noqa: E402
from serve_load import BATCH_PROMPTS  # noqa: E402

Q = "\n\nWhat is the text above about? Answer in detail."
TIMED = ("_prefill_chunk", "_decode_batch", "_decode_step", "_emit")


class Timers:
    """CPU seconds (this thread) in the engine's methods named in TIMED."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.orig = {n: getattr(Engine, n) for n in TIMED}
        for n in TIMED:
            setattr(Engine, n, self._wrap(n, self.orig[n]))

    def _wrap(self, name: str, f: Any) -> Any:
        def g(eng: Engine, *a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return f(eng, *a, **k)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - t0

        return g

    def take(self) -> dict[str, float]:
        out, self.cpu = self.cpu, {}
        return out


def pct(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else None


def e2e(model: Any, tok: Any, cfg: Any, prompts: list[list[int]], args: Any, timers: Timers, **kw: Any) -> dict:
    eng = Engine(model, tok, cfg, max_concurrent=len(prompts), **kw)
    eng.run_sync(Sequence(prompts[0], Sampling(max_tokens=2, temperature=0), "t", None))  # warm
    timers.take()
    seqs = [Sequence(p, Sampling(max_tokens=args.max_tokens, temperature=0), "t", None) for p in prompts]
    t0, c0 = time.perf_counter(), time.process_time()
    for s in seqs:
        eng.submit(s)
    while not all(s.done.is_set() for s in seqs):
        eng.step()
        eng.wait_admitted()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(s.token_times) for s in seqs)
    gaps = [b - a for s in seqs for a, b in zip(s.token_times, s.token_times[1:])]
    return {
        "engine": kw,
        "generated_tokens": tokens,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
        "ttft_s": {"p50": pct([s.t_first - s.t_submit for s in seqs if s.t_first], 50)},
        "inter_token_s": {"p50": pct(gaps, 50), "p99": pct(gaps, 99)},
        "cpu_s_in": timers.take(),
        "decode_forwards": eng.decode_forwards,
        "decode_rows": eng.decode_rows,
        "packed_chunks": eng.packed_chunks,
        "answers": [s.generated for s in seqs],
    }


def rounds(model: Any, tok: Any, cfg: Any, prompts: list[list[int]], args: Any, max_batch: int) -> dict:
    eng = Engine(model, tok, cfg, max_concurrent=len(prompts), max_batch=max_batch, restore_off_thread=False)
    seqs = [Sequence(p, Sampling(max_tokens=10_000, temperature=0), "t", None) for p in prompts]
    for s in seqs:
        eng.submit(s)
    while not all(s.generated or s.done.is_set() for s in seqs):
        eng.step()
    eng.step()
    live = [s for s in seqs if not s.done.is_set()]
    emitted = sum(len(s.token_times) for s in seqs)
    pr = cProfile.Profile(time.thread_time)  # CPU time, as the round: other jobs do not count
    t0 = time.thread_time()
    pr.enable()
    for _ in range(args.rounds):
        eng.step()
    pr.disable()
    per_round = (time.thread_time() - t0) / args.rounds
    tokens = sum(len(s.token_times) for s in seqs) - emitted
    st = pstats.Stats(pr)
    parts: dict[str, float] = {}
    for (path, _, fn), (_, _, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        name = f"{Path(path).name}:{fn}"
        parts[name] = max(parts.get(name, 0.0), ct)
        if fn == "<built-in method torch._C._nn.linear>":
            parts["linear (self)"] = tt
    pick = {
        "linear layers": parts.get("linear (self)", 0.0),
        "rows' attention (rows_attention)": parts.get("batched.py:rows_attention", 0.0),
        "  of which the short rows' one SDPA and bookkeeping (_attend_short)": parts.get(
            "batched.py:_attend_short", 0.0
        ),
        "per-row layer steps (FlashLayer.step: selection, gather, assembly, attention)": parts.get(
            "flash_layer.py:step", 0.0
        ),
        "cache updates (BatchedCache.update)": parts.get("batched.py:update", 0.0),
        "sampling and emitting (Engine._emit)": parts.get("engine.py:_emit", 0.0),
        "gauges (Engine._gauges)": parts.get("engine.py:_gauges", 0.0),
    }
    return {
        "max_batch": max_batch,
        "rows_at_start": len(live),
        "tokens": tokens,
        "tokens_per_cpu_s": tokens / (per_round * args.rounds),
        "ms_per_round_cpu": per_round * 1e3,
        "ms_per_round_parts": {k: v / args.rounds * 1e3 for k, v in pick.items()},
    }


def _append_only(batch: Any, query: torch.Tensor, rows: list[Any], scaling: float, out: torch.Tensor) -> None:
    from flashmem.cache.tiered_attention import group_queries

    seen = torch.ones(1, 1, dtype=torch.bool, device=query.device)
    for ans in rows:
        layer = ans.k._flashmem_layer
        k_new, v_new = layer.take_pending()
        group = query.shape[1] // k_new.shape[1]
        layer.append(k_new, v_new, seen, group_queries(query[:, :, ans.at : ans.at + 1], group), group)


def _nothing(batch: Any, query: torch.Tensor, rows: list[Any], scaling: float, out: torch.Tensor) -> None:
    for ans in rows:
        ans.k._flashmem_layer.take_pending()


def ablation(model: Any, tok: Any, cfg: Any, prompts: list[list[int]], args: Any) -> dict:
    from flashmem.cache import batched

    real = batched._attend_short

    def per_round(max_batch: int) -> tuple[float, float]:
        eng = Engine(model, tok, cfg, max_concurrent=len(prompts), max_batch=max_batch, restore_off_thread=False)
        eng.eos_ids = set()
        seqs = [Sequence(p, Sampling(max_tokens=10_000, temperature=0), "t", None) for p in prompts]
        for s in seqs:
            eng.submit(s)
        for _ in range(3):
            eng.step()
        n0 = sum(len(s.token_times) for s in seqs)
        t0 = time.thread_time()
        for _ in range(args.rounds * 3):
            eng.step()
        dt = time.thread_time() - t0
        tokens = sum(len(s.token_times) for s in seqs) - n0
        for s in seqs:
            s.cancel()
        eng.step()
        return dt / (args.rounds * 3) * 1e3, dt / tokens * 1e3

    out: dict[str, float] = {}
    try:
        for name, impl in (("as is", real), ("append only", _append_only), ("no attention work", _nothing)):
            batched._attend_short = impl
            out[f"batched ms per round, {name}"] = per_round(len(prompts))[0]
    finally:
        batched._attend_short = real
    out["unbatched ms per token"] = per_round(1)[1]
    return out


def every_page_ab(model: Any, tok: Any, cfg: Any, prompts: list[list[int]], args: Any) -> dict:
    from flashmem.cache import tiered_attention

    shortcut = tiered_attention.selects_every_page
    modes = {"every page unranked": shortcut, "ranked (as before)": lambda *a: False}
    return alternating_ab(model, tok, cfg, prompts, args, *_swaps(tiered_attention, "selects_every_page", modes))


def shared_ab(model: Any, tok: Any, cfg: Any, prompts: list[list[int]], args: Any) -> dict:
    from flashmem.cache import batched

    shared = batched._short_decode

    def before(ans: Any) -> bool:  # stop 50: only rows with no sealed block shared the SDPA
        return shared(ans) and ans.k._flashmem_layer.num_sealed == 0

    modes = {"every-page rows in the shared SDPA": shared, "every-page rows' own steps (as before)": before}
    return alternating_ab(model, tok, cfg, prompts, args, *_swaps(batched, "_short_decode", modes))


def layout_ab(model: Any, tok: Any, cfg: Any, prompts: list[list[int]], args: Any) -> dict:
    from flashmem.models.weight_layout import linear_layout, set_linear_layout

    keep = linear_layout(model)
    layouts = args.layouts.split(",")
    modes = {f"weights {lay}": (lambda lay=lay: set_linear_layout(model, lay)) for lay in layouts}
    set_linear_layout(model, layouts[0])  # the warm rounds in the first (onednn's products are timed there)
    return alternating_ab(model, tok, cfg, prompts, args, modes, lambda: set_linear_layout(model, keep))


def attend_ab(model: Any, tok: Any, cfg: Any, prompts: list[list[int]], args: Any) -> dict:
    import importlib.util

    from flashmem.cache import batched

    spec = importlib.util.spec_from_file_location("batched_other", args.attend_ab)
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other  # its dataclasses look their module up
    spec.loader.exec_module(other)
    modes = {"this tree": batched._attend_short, args.attend_ab: other._attend_short}
    return alternating_ab(model, tok, cfg, prompts, args, *_swaps(batched, "_attend_short", modes), batched_only=True)


def _swaps(module: Any, name: str, fns: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Modes that set `module.name` to each function, and the reset that puts it back."""
    keep = getattr(module, name)
    modes = {mode: (lambda fn=fn: setattr(module, name, fn)) for mode, fn in fns.items()}
    return modes, lambda: setattr(module, name, keep)


def alternating_ab(
    model: Any,
    tok: Any,
    cfg: Any,
    prompts: list[list[int]],
    args: Any,
    modes: dict[str, Any],
    reset: Any,
    batched_only: bool = False,
) -> dict:
    """The prompts decoded batched and with max_batch 1 (not with `batched_only`), EOS ignored,
    after `--warm-rounds` rounds, in blocks of `--rounds` rounds that alternate (`--ab-blocks`
    times each) between the modes (each a function that puts the process in that mode; `reset`
    undoes them): CPU ms per round and per token, not profiled."""
    out: dict[str, Any] = {}
    for max_batch in (len(prompts),) if batched_only else (len(prompts), 1):
        eng = Engine(model, tok, cfg, max_concurrent=len(prompts), max_batch=max_batch, restore_off_thread=False)
        eng.eos_ids = set()
        seqs = [Sequence(p, Sampling(max_tokens=10_000, temperature=0), "t", None) for p in prompts]
        for s in seqs:
            eng.submit(s)
        while not all(s.generated for s in seqs):
            eng.step()
        for _ in range(1 + args.warm_rounds):
            eng.step()
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        tokens: dict[str, int] = {m: 0 for m in modes}
        try:
            for _ in range(args.ab_blocks):
                for mode, apply in modes.items():
                    apply()
                    n0 = sum(len(s.token_times) for s in seqs)
                    t0 = time.thread_time()
                    for _ in range(args.rounds):
                        eng.step()
                    cpu[mode].append(time.thread_time() - t0)
                    tokens[mode] += sum(len(s.token_times) for s in seqs) - n0
        finally:
            reset()
        sealed = [s.cache.flash_layers[0].num_sealed for s in seqs if s.cache is not None]
        for s in seqs:
            s.cancel()
        eng.step()
        out[f"max_batch {max_batch}"] = {
            "sealed_blocks_layer0_at_end": sealed,
            **{
                mode: {
                    "ms_per_round_cpu": [1e3 * c / args.rounds for c in cpu[mode]],
                    "ms_per_token_cpu": 1e3 * sum(cpu[mode]) / tokens[mode],
                }
                for mode in modes
            },
        }
    if batched_only:  # the modes' ratio, block by block (the box's speed moves between blocks)
        rounds = [out[f"max_batch {len(prompts)}"][m]["ms_per_round_cpu"] for m in modes]
        ratios = sorted(a / b for a, b in zip(*rounds))
        out[f"{' over '.join(modes)}, per block"] = ratios
        out[f"{' over '.join(modes)}, median"] = ratios[len(ratios) // 2]
        return out
    for mode in modes:
        b, u = out[f"max_batch {len(prompts)}"][mode], out["max_batch 1"][mode]
        out[f"batched over unbatched, {mode}"] = u["ms_per_token_cpu"] / b["ms_per_token_cpu"]
    return out


def forwards(model: Any, b: int) -> dict:
    from transformers import DynamicCache

    def t(rows: int, q: int, reps: int = 5) -> float:
        best = float("inf")
        for _ in range(reps):
            c = DynamicCache()
            with torch.inference_mode():
                model(torch.randint(3, 1000, (rows, 40)), cache=c, use_cache=True, logits_to_keep=1)
                t0 = time.thread_time()
                model(torch.randint(3, 1000, (rows, q)), cache=c, use_cache=True, logits_to_keep=1)
            best = min(best, time.thread_time() - t0)
        return best * 1e3

    return {
        "decode_batch_1_ms": t(1, 1),
        f"decode_batch_{b}_ms": t(b, 1),
        "prompt_1x40_ms": t(1, 40),
        f"prompt_1x{40 * b}_ms": t(1, 40 * b, reps=3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--config", default=None, help="default: configs/cpu-small.yaml (float32)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--round-context", type=int, default=0, help="round: N-token documents as prompts (0: chat)")
    ap.add_argument("--ablation-only", action="store_true", help="part 3 alone (a quick A/B of the round's cost)")
    ap.add_argument("--every-page-ab", action="store_true", help="long rows, every-page shortcut on/off")
    ap.add_argument(
        "--shared-ab", action="store_true",
        help="rows that attend every sealed page: in the batch's shared SDPA or their own steps (alternating)",
    )  # fmt: skip
    ap.add_argument(
        "--layout-ab", action="store_true",
        help="the linear weights stored [in, out] or [out, in] (flashmem.models.weight_layout), alternating",
    )  # fmt: skip
    ap.add_argument(
        "--attend-ab", default=None, metavar="FILE",
        help="this tree's batched._attend_short or FILE's (another tree's cache/batched.py), alternating",
    )  # fmt: skip
    ap.add_argument(
        "--weight-layout", default="auto", help="the model's linear weights (flashmem.models.weight_layout)"
    )
    ap.add_argument("--layouts", default="in_major,out_major", help="--layout-ab: the weight layouts, the first warmed")
    ap.add_argument("--ab-blocks", type=int, default=2, help="A/Bs: blocks of --rounds rounds per mode")
    ap.add_argument("--warm-rounds", type=int, default=0, help="A/Bs: rounds decoded before measuring")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="the model's dtype; other than float32 without --config, the recipe sized for its bytes",
    )  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.every_page_ab and not args.round_context:
        args.round_context = 1000
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype), weight_layout=args.weight_layout)
    if args.config is None and args.dtype != "float32":  # as `flashmem serve --dtype` sizes it
        cfg = sized_default_config(model)
    else:
        cfg = FlashMemoryConfig.from_yaml(args.config or ROOT / "configs" / "cpu-small.yaml")
    prompts = [
        chat_prompt_ids(tok, [{"role": "user", "content": BATCH_PROMPTS[i % len(BATCH_PROMPTS)]}])
        for i in range(args.clients)
    ]
    long_prompts = prompts
    if args.round_context:
        from flashmem.texts import haystack

        long_prompts = [
            chat_prompt_ids(tok, [{"role": "user", "content": haystack(tok, args.round_context, seed=i) + Q}])
            for i in range(args.clients)
        ]
    if args.every_page_ab or args.shared_ab or args.layout_ab or args.attend_ab:
        out_e = {"command": "python benchmarks/diagnostics/batch_rounds.py " + " ".join(sys.argv[1:])}
        out_e["round_prompt_tokens"] = [len(p) for p in long_prompts]
        out_e["cpu"] = cpu_name()
        ab, key = (
            (every_page_ab, "every_page_ab") if args.every_page_ab
            else (shared_ab, "shared_ab") if args.shared_ab
            else (attend_ab, "attend_ab") if args.attend_ab
            else (layout_ab, "layout_ab")
        )  # fmt: skip
        out_e[key] = ab(model, tok, cfg, long_prompts, args)
        print(json.dumps(out_e, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(out_e, indent=1) + "\n")
        return
    if args.ablation_only:
        out_a = {"command": "python benchmarks/diagnostics/batch_rounds.py " + " ".join(sys.argv[1:])}
        out_a["ablation"] = ablation(model, tok, cfg, prompts, args)
        print(json.dumps(out_a, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(out_a, indent=1) + "\n")
        return
    timers = Timers()
    runs = {
        "unbatched": e2e(model, tok, cfg, prompts, args, timers, max_batch=1, restore_off_thread=False),
        "batched_chunk_alone": e2e(model, tok, cfg, prompts, args, timers, pack_prefill=False),
        "batched": e2e(model, tok, cfg, prompts, args, timers),
    }
    for n in TIMED:
        setattr(Engine, n, timers.orig[n])
    answers = [r.pop("answers") for r in runs.values()]
    base = runs["unbatched"]["tokens_per_s"]
    out = {
        "command": "python benchmarks/diagnostics/batch_rounds.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "config": args.config,
        "torch_threads": 1,
        "prompt_tokens": [len(p) for p in prompts],
        "e2e": runs,
        "tokens_per_s_over_unbatched": {k: r["tokens_per_s"] / base for k, r in runs.items()},
        "answers_identical": all(a == answers[0] for a in answers),
        "round_prompt_tokens": [len(p) for p in long_prompts],
        "round": [rounds(model, tok, cfg, long_prompts, args, mb) for mb in (args.clients, 1)],
        "ablation": ablation(model, tok, cfg, prompts, args),
        "forward": forwards(model, args.clients),
        "cpu_count": os.cpu_count(),
        "gauge_s": engine_mod.GAUGE_S,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
