"""The exact prompt fed in forwards, each forward's tail split off (before stop 60) or not, in one process.

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/prefill_tail_split_ab.py [--model smollm2]
        [--tokens 4096] [--budget 0.125] [--rounds 4] [--json-out FILE]

A prompt of `--tokens` tokens of the default text goes into the recipe at `--budget` in forwards
of `prefill_chunk` tokens (as the task harness and the server feed it), `--rounds` times each
way, taking turns: with each forward's last 32 queries and its last query split off into chunks
of their own (`attention.query_chunks` with the split forced, as every exact forward had it) and
as one chunk (this tree: an exact forward selects nothing, so it does not split). With the
prompt streamed from the tiers, every chunk reads every sealed block once. Prints and writes the
median seconds, their ratio, the cold-tier bytes read (`h2d_bytes`) each way, and the largest
difference between the two ways' last logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a harness model name (smollm2, tiny, ...)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    from flashmem.cache import attention
    from flashmem.config import FlashMemoryConfig
    from flashmem.texts import load_text
    from flashmem_eval import harness as H

    torch.set_num_threads(1)
    loaded = H.load(a.model)
    model, tok = loaded.model, loaded.tokenizer
    ids = tok(load_text("default")[: a.tokens * 8], return_tensors="pt").input_ids[:, : a.tokens]
    plain = attention.query_chunks

    def split_always(q: int, step: int, split_tail: bool = True) -> list[tuple[int, int]]:
        return plain(q, step, True)

    seconds: dict[str, list[float]] = {"split": [], "one": []}
    h2d: dict[str, int] = {}
    last: dict[str, torch.Tensor] = {}
    for r in range(a.rounds):
        for mode in ("split", "one") if r % 2 == 0 else ("one", "split"):
            attention.query_chunks = split_always if mode == "split" else plain
            try:
                cfg = FlashMemoryConfig.for_budget(a.budget, int(ids.shape[1]), model)
                with torch.no_grad():
                    cache, logits, dt = H.prefill_flashmem(model, ids, cfg)
                h2d[mode] = int(cache.traffic_report()["totals"]["h2d_bytes"])
                cache.close()
            finally:
                attention.query_chunks = plain
            seconds[mode].append(dt)
            last[mode] = logits
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out: dict[str, Any] = {
        "command": f"python benchmarks/diagnostics/prefill_tail_split_ab.py --model {a.model} --tokens {a.tokens} "
        f"--budget {a.budget} --rounds {a.rounds}",
        "tokens": int(ids.shape[1]),
        "seconds": seconds,
        "median_s": med,
        "one_over_split": med["one"] / med["split"],
        "h2d_bytes": h2d,
        "h2d_one_over_split": h2d["one"] / h2d["split"] if h2d["split"] else None,
        "last_logits_max_diff": (last["one"] - last["split"]).abs().max().item(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(out, indent=1))
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
