"""Retrieval rows restricted to the prompts every listed method ran at every listed budget.

A table pooled over runs that covered different prompts compares methods on
different samples (flashmem on 96 prompts, a press on 24). This writes a
`flashmem bench`-format JSON holding, for each (method, budget) listed, only the
prompts (task, haystack, length, depth, seed) that every one of them has a row
for, with the merged files' runs as its provenance; `flashmem report` then
builds the README table from it.

    python benchmarks/diagnostics/common_prompts.py results/retrieval_gemma3_current.json \
        results/retrieval_gemma3_kvpress_rerun.json \
        --methods full,flashmem,streaming,snapkv,kvpress:KeyDiffPress --budgets 1/8,1/16 \
        --out results/retrieval_gemma3_common.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _budget(text: str) -> float:
    a, _, b = text.partition("/")
    return float(a) / float(b) if b else float(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="retrieval result JSONs written by `flashmem bench`")
    ap.add_argument("--methods", required=True, help="comma list; full is taken at budget 1")
    ap.add_argument("--budgets", required=True, help="comma list, e.g. 1/8,1/16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from flashmem_eval.report import _prompt_key, load_rows

    rows, runs = load_rows(a.files)
    rows = [r for r in rows if r.get("suite") == "retrieval" and not r.get("error") and "correct" in r]
    budgets = [_budget(b) for b in a.budgets.split(",")]
    wanted = [(m, 1.0) if m == "full" else (m, b) for m in a.methods.split(",") for b in budgets]
    wanted = list(dict.fromkeys(wanted))
    have: dict[tuple[str, float], set[tuple]] = {w: set() for w in wanted}
    for r in rows:
        w = (r["method"], float(r["budget"]))
        if w in have:
            have[w].add(_prompt_key(r))
    common = set.intersection(*have.values()) if have else set()
    if not common:
        raise SystemExit(f"no prompt is common to {wanted}")
    keep = [r for r in rows if (r["method"], float(r["budget"])) in have and _prompt_key(r) in common]
    # the runs that measured a kept row (by method, length and seed), not every run of the files
    used = {(r["method"], int(r["length"]), r.get("seed")) for r in keep}
    runs = [
        run
        for run in runs
        if any(
            (m, int(L), s) in used
            for m in run.get("methods", [])
            for L in run.get("lengths", [])
            for s in run.get("seeds", [])
        )
    ]
    doc = {
        "meta": {"suite": "retrieval", "runs": runs, "common_prompts": len(common), "sources": a.files},
        "rows": keep,
    }
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"{len(common)} prompts common to {len(wanted)} method/budget pairs; {len(keep)} rows -> {a.out}")


if __name__ == "__main__":
    main()
