"""What a redone near tie's two tokens held, and whether its redo changed the token.

Runs the task suite (`python -m flashmem_eval.task_suite`, the arguments after `--`) with a hook
on exact_on_doubt's redo (cache/doubt.py) that appends one JSON line per redone step to --out:
the prompt's ordinal in the run, the selecting step's top-two logit gap and probabilities, the
redo's top probability, and whether the redo gave another next token. The suite writes its
own rows as usual. docs/results.md, "Near ties in a flat distribution" (stop 63):

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/doubt_masses.py --out masses.jsonl -- run FILE.json \\
      --stored-prompts --answered-only --model smollm2 --methods flashmem:doubt --budgets 1/16 \\
      --lengths 4096 --families multiquery --threads 1
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flashmem.cache import doubt


def hook_redos(out_path: str, family: str) -> None:
    """Wrap doubt._after (looked up when the hooks are installed, at attach) to record each redo."""
    after = doubt._after
    prompts: dict[int, int] = {}

    def recorded(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        cache = doubt._cache_of(kwargs)
        redone = after(module, args, kwargs, output)
        if redone is None or cache is None:
            return redone
        sel, red = output.logits[:1, -1].float(), redone.logits[:1, -1].float()  # [1, V]: the suite runs one row
        top = sel.softmax(-1).topk(2).values[0]
        row = {
            "family": family,
            "prompt": prompts.setdefault(id(cache), len(prompts)),
            "gap": float(doubt.top_gap(sel)[0]),  # what the redo was decided on
            "p1": float(top[0]),
            "p2": float(top[1]),  # p1 + p2: doubt.top_two_mass, what exact_on_doubt_min_mass reads
            "changed": int(sel.argmax()) != int(red.argmax()),
            "redo_p1": float(red.softmax(-1).max()),
        }
        with open(out_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return redone

    doubt._after = recorded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON lines, one per redone step (appended)")
    ap.add_argument("suite", nargs=argparse.REMAINDER, help="-- then the task suite's arguments")
    args = ap.parse_args()
    suite = [a for a in args.suite if a != "--"] if args.suite[:1] == ["--"] else args.suite
    fam = suite[suite.index("--families") + 1] if "--families" in suite else "all"
    hook_redos(args.out, fam)
    from flashmem_eval import task_suite

    task_suite.main(suite)


if __name__ == "__main__":
    main()
