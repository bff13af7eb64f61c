"""One memory-suite cell in a fresh process, so peak RSS belongs to that cell alone.

    python -m flashmem_eval.memcell '{"model": ..., "method": ..., "budget": ..., "length": ...}'

Prints one JSON line: the cell's measured cache bytes and ratios, RSS after
loading the model (`rss_model`), the peak RSS while the cell ran (`rss_peak`:
VmHWM after resetting it with /proc/self/clear_refs once the model is loaded,
so the load's own peak is excluded) and their difference (`rss_peak_over_model`).
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import psutil
    import torch

    from flashmem_eval import harness as H
    from flashmem_eval.baselines import parse_method
    from flashmem_eval.suites import done_local, fidelity_ids, local_cache

    torch.set_num_threads(int(spec.get("threads", 2)))
    loaded = H.load(spec["model"])
    L = int(spec["length"])
    prompt, _ = fidelity_ids(loaded.tokenizer, L, 8, 0)
    m = parse_method(spec["method"])
    import gc

    gc.collect()
    rss_model = psutil.Process().memory_info().rss
    reset = _reset_peak()  # so the peak below is this cell's, not the model load's
    shared: dict[str, Any] = {}
    cache, logits, info = local_cache(loaded, m, float(spec["budget"]), prompt, shared)
    if "pre" in shared:  # eviction baselines: the full prefill cache is dropped after compression
        shared["pre"] = None
    H.greedy(loaded.model, cache, torch.tensor([[int(logits.argmax())]]), 8)
    row = H.cache_ratios(loaded.model, cache, L + 8)
    done_local(shared, loaded)
    peak = _peak_rss() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row.update(
        rss_model=rss_model,
        rss_peak=peak,
        rss_peak_over_model=peak - rss_model,
        rss_peak_source="VmHWM after clear_refs" if reset else "ru_maxrss (includes model load)",
        prefill_s=info.get("prefill_s"),
    )
    return row


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    row = run(json.loads(argv[0]))
    print("MEMCELL " + json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
