"""One memory-suite cell in a fresh process, so peak RSS belongs to that cell alone.

    python -m flashmem.eval.memcell '{"model": ..., "method": ..., "budget": ..., "length": ...}'

Prints one JSON line: the cell's measured cache bytes and ratios, RSS after
loading the model (`rss_model`), the process's peak RSS (`rss_peak`, from
getrusage) and their difference (`rss_peak_over_model`).
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import psutil
    import torch

    from flashmem.baselines import parse_method
    from flashmem.eval import harness as H
    from flashmem.eval.suites import _done_local, _local_cache, fidelity_ids

    torch.set_num_threads(int(spec.get("threads", 2)))
    loaded = H.load(spec["model"])
    L = int(spec["length"])
    prompt, _ = fidelity_ids(loaded.tokenizer, L, 8, 0)
    m = parse_method(spec["method"])
    rss_model = psutil.Process().memory_info().rss
    shared: dict[str, Any] = {}
    cache, logits, info = _local_cache(loaded, m, float(spec["budget"]), prompt, shared)
    if "pre" in shared:  # eviction baselines: the full prefill cache is dropped after compression
        shared["pre"] = None
    H.greedy(loaded.model, cache, torch.tensor([[int(logits.argmax())]]), 8)
    row = H.cache_ratios(loaded.model, cache, L + 8)
    _done_local(shared, loaded)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    row.update(rss_model=rss_model, rss_peak=peak, rss_peak_over_model=peak - rss_model,
               prefill_s=info.get("prefill_s"))
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    row = run(json.loads(argv[0]))
    print("MEMCELL " + json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
