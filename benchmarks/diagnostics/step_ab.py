"""A decode step of this tree against another tree's versions of some functions, alternating on one cache.

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/step_ab.py --swap MODULE:ATTR=FILE [--swap ...]
        [--model smollm2] [--tokens 8192] [--budget 0.125] [--steps 24] [--json-out FILE]

For a change that leaves every logit as it was (a faster layout, fewer operators): prefills the
model's default text into the recipe (`FlashMemoryConfig.for_budget`) once, then runs greedy
decode steps on that one cache, each step with this tree's functions ("new") or with the named
functions replaced by their versions in FILE ("old", e.g. `git show REV:src/flashmem/cache/x.py >
FILE`), and a DynamicCache prefilled with the same text beside them; the three take turns, their
order rotating every step, so the box's drift (up to 40% within the hour on these shared
machines) hits them alike. A swap names a module-level function or a class attribute
(`flashmem.cache.rerank_codes:KeyMirror.logits=/tmp/old/rerank_codes.py`); FILE is loaded as a
module of its own, so its functions read its own globals. Both versions act on the same cache,
so the step before decides the state each finds: only changes whose steps leave the same state
are measured fairly this way. Prints and writes the median ms a step of each and the ratios.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import time
from typing import Any

import torch


def load_swaps(specs: list[str]) -> list[tuple[Any, str, Any, Any]]:
    """MODULE:ATTR=FILE specs -> (owner, name, this tree's value, FILE's value) each."""
    out = []
    for i, spec in enumerate(specs):
        target, _, path = spec.partition("=")
        mod_name, _, attr = target.partition(":")
        if not (mod_name and attr and path):
            raise SystemExit(f"--swap {spec!r}: expected MODULE:ATTR=FILE")
        loader = importlib.util.spec_from_file_location(f"_step_ab_old_{i}", path)
        if loader is None or loader.loader is None:
            raise SystemExit(f"--swap {spec!r}: cannot load {path}")
        old_mod = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(old_mod)
        owner, old_owner = importlib.import_module(mod_name), old_mod
        *path_parts, name = attr.split(".")
        for p in path_parts:
            owner, old_owner = getattr(owner, p), getattr(old_owner, p)
        if isinstance(owner, type):  # the class's own entry (a staticmethod stays one)
            out.append((owner, name, owner.__dict__[name], old_owner.__dict__[name]))
        else:
            out.append((owner, name, getattr(owner, name), getattr(old_owner, name)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swap", action="append", default=[], metavar="MODULE:ATTR=FILE")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    if not a.swap:
        raise SystemExit("give at least one --swap MODULE:ATTR=FILE")
    from transformers import DynamicCache

    import flashmem
    from flashmem.texts import load_text

    swaps = load_swaps(a.swap)

    def use(which: str) -> None:
        for owner, name, new, old in swaps:
            setattr(owner, name, new if which == "new" else old)

    torch.set_num_threads(1)
    model, tokenizer = flashmem.load_model(a.model)
    ids = tokenizer(load_text("default")[: a.tokens * 8], return_tensors="pt").input_ids[:, : a.tokens]
    cfg = flashmem.FlashMemoryConfig.for_budget(a.budget, a.tokens, model)

    def step(cache: Any, tok: torch.Tensor) -> torch.Tensor:
        return model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)

    times: dict[str, list[float]] = {"old": [], "new": [], "dynamic": []}
    try:
        with flashmem.attach(model, cfg) as cache, torch.no_grad():
            tok = flashmem.prefill(model, cache, ids, chunk=8192)[:, -1].argmax(-1, keepdim=True)
            dyn = DynamicCache()
            tok_d = model(ids, cache=dyn, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            for which in ("old", "new"):  # warm-up of each
                use(which)
                tok = step(cache, tok)
            tok_d = step(dyn, tok_d)
            order = ["old", "new", "dynamic"]
            for s in range(a.steps):
                for which in order[s % 3 :] + order[: s % 3]:
                    t0 = time.perf_counter()
                    if which == "dynamic":
                        tok_d = step(dyn, tok_d)
                    else:
                        use(which)
                        tok = step(cache, tok)
                    times[which].append(time.perf_counter() - t0)
    finally:
        use("new")
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    out = {
        "command": "python benchmarks/diagnostics/step_ab.py " + " ".join(f"--swap {s}" for s in a.swap),
        "model": a.model,
        "tokens": a.tokens,
        "budget": a.budget,
        "steps": a.steps,
        "step_ms_median": med,
        "new_over_old": med["new"] / med["old"],
        "dynamic_over_new": med["dynamic"] / med["new"],
        "dynamic_over_old": med["dynamic"] / med["old"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "command"}, indent=1))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
