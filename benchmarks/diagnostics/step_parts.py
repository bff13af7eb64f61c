"""Where a decode step's time goes, part by part, beside DynamicCache's step in the same process.

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/step_parts.py [--model smollm2] [--tokens 8192]
        [--budget 0.125] [--steps 8] [--json-out FILE]

Prefills the model's default text into the recipe (`FlashMemoryConfig.for_budget`) and into a
DynamicCache, then runs greedy decode steps alternating between the two. Each flashmem step's
parts are timed by wrapping the functions that do them (a CPU runs them synchronously, so wall
time is theirs; nested parts are inside their parents: `history` holds `rank` and `ws.gather`,
`asm.attend` holds `sdpa` and `concat`). Prints the median step of each cache and the parts' mean
ms per step. profile_decode.py gives the cProfile view of the same step.

`--op-times N`: then N more flashmem steps with every ATen operator timed and charged to the
innermost flashmem function on the stack (the model's own operators to `model`): ms a step and
operators a layer per function, the busiest first (`op_times` in the JSON). Each operator is
timed from Python, so a step takes longer under it; the shares are what it is for.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

# (module path, attribute path, label): the parts timed, outermost first
PARTS = [
    ("flashmem.cache.flash_layer", "FlashLayer.step", "layer step (all of flashmem's attention)"),
    ("flashmem.cache.tiered_attention", "_add_history", "history: select, gather, rest entry"),
    ("flashmem.cache.ranking", "CandidateRanker.rank", "rank: index and re-rank"),
    ("flashmem.cache.rerank_codes", "KeyMirror.logits", "re-rank: the key copy's logits"),
    ("flashmem.cache.ranking", "token_page_mass", "re-rank: token logits to page mass"),
    ("flashmem.cache.ranking", "top_pages", "re-rank: top pages"),
    ("flashmem.cache.ranking", "CandidateRanker.scores", "index scores"),
    ("flashmem.cache.working_set", "WorkingSet.gather", "working set: gather"),
    ("flashmem.cache.working_set", "WorkingSet.merge", "working set: merge new pages"),
    ("flashmem.cache.tiered_attention", "rest_entry", "rest entry: logit"),
    ("flashmem.cache.assembly", "Assembly.attend", "attention: assembly and SDPA"),
    ("flashmem.cache.assembly", "concat", "attention: K/V into buffers (int8 decoded)"),
    ("flashmem.cache.assembly", "RestEntry.value", "attention: rest entry's value"),
    ("flashmem.cache.sdpa", "attention", "attention: SDPA"),
]


def wrap_parts(acc: dict[str, float]) -> Callable[[], None]:
    """Wrap PARTS so each call adds its wall time to acc[label] -> a function undoing it."""
    import importlib

    undo = []
    for mod_name, attr, label in PARTS:
        owner: Any = importlib.import_module(mod_name)
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def timed(*a: Any, _orig: Any = orig, _label: str = label, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                acc[_label] += time.perf_counter() - t0

        setattr(owner, name, functools.wraps(orig)(timed))
        undo.append((owner, name, orig))

    def restore() -> None:
        for owner, name, orig in undo:
            setattr(owner, name, orig)

    return restore


def op_times(run: Callable[[], object], steps: int, layers: int, top: int = 30) -> list[dict[str, Any]]:
    """run() `steps` times with every dispatched operator timed and charged to the innermost
    flashmem function on the stack -> the `top` functions: ms a step, operators a layer."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    secs: dict[str, float] = collections.defaultdict(float)
    ops: dict[str, int] = collections.defaultdict(int)

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            f, where = sys._getframe(1), "model"
            while f is not None:
                name = f.f_code.co_filename
                if "/flashmem/" in name and "_python_dispatch" not in name:
                    where = f"{name.split('/flashmem/')[-1]}:{f.f_code.co_name}"
                    break
                f = f.f_back
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            secs[where] += time.perf_counter() - t0
            ops[where] += 1
            return out

    with Timed():
        for _ in range(steps):
            run()
    busiest = sorted(secs, key=secs.__getitem__, reverse=True)[:top]
    return [{"function": w, "ms": 1e3 * secs[w] / steps, "ops_per_layer": ops[w] / steps / layers} for w in busiest]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--config", default=None, help="a YAML config (e.g. configs/cpu-small.yaml) instead of the recipe")
    ap.add_argument("--op-times", type=int, default=0, metavar="N", help="N more steps, each operator timed")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    from transformers import DynamicCache

    import flashmem
    from flashmem.texts import load_text

    torch.set_num_threads(1)
    model, tokenizer = flashmem.load_model(a.model)
    ids = tokenizer(load_text("default")[: a.tokens * 8], return_tensors="pt").input_ids[:, : a.tokens]
    cfg = (
        flashmem.FlashMemoryConfig.from_yaml(a.config)
        if a.config
        else flashmem.FlashMemoryConfig.for_budget(a.budget, a.tokens, model)
    )

    def step(cache: Any, tok: torch.Tensor) -> torch.Tensor:
        return model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)

    acc: dict[str, float] = collections.defaultdict(float)
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        tok_f = flashmem.prefill(model, cache, ids, chunk=8192)[:, -1].argmax(-1, keepdim=True)
        dyn = DynamicCache()
        tok_d = model(ids, cache=dyn, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tok_f, tok_d = step(cache, tok_f), step(dyn, tok_d)  # warm-up
        undo = wrap_parts(acc)
        t_f, t_d = [], []
        try:
            for _ in range(a.steps):
                t0 = time.perf_counter()
                tok_f = step(cache, tok_f)
                t_f.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                tok_d = step(dyn, tok_d)
                t_d.append(time.perf_counter() - t0)
        finally:
            undo()
        by_function: list[dict[str, Any]] = []
        if a.op_times:

            def one() -> None:
                nonlocal tok_f
                tok_f = step(cache, tok_f)

            by_function = op_times(one, a.op_times, model.config.num_hidden_layers)
    out = {
        "model": a.model,
        "tokens": a.tokens,
        "budget": None if a.config else a.budget,
        "config_file": a.config,
        "steps": a.steps,
        "flashmem_step_ms": 1e3 * statistics.median(t_f),
        "dynamic_step_ms": 1e3 * statistics.median(t_d),
        "parts_ms": {k: 1e3 * v / a.steps for k, v in acc.items()},
        "config": {"lsa_top_k": cfg.lsa_top_k, "gpu_cache_limit": cfg.gpu_cache_limit},
        "op_times": by_function,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"flashmem {out['flashmem_step_ms']:.1f} ms a step, DynamicCache {out['dynamic_step_ms']:.1f} ms "
          f"({out['dynamic_step_ms'] / out['flashmem_step_ms']:.2f}x DynamicCache's speed)")  # fmt: skip
    for _, _, label in PARTS:
        if label in out["parts_ms"]:
            print(f"  {out['parts_ms'][label]:7.2f} ms  {label}")
    if by_function:
        print(f"each operator timed, {a.op_times} steps (ms a step, operators a layer, innermost flashmem function):")
        for row in by_function:
            print(f"  {row['ms']:7.2f} ms {row['ops_per_layer']:6.1f}  {row['function']}")
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
