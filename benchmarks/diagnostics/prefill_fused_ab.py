"""The exact prompt's attention with and without PyTorch's fused CPU kernel, beside DynamicCache, in one process.

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/prefill_fused_ab.py [--model smollm2] [--tokens 4096]
        [--rounds 2] [--config configs/cpu-small.yaml] [--prefill-chunk N] [--json-out FILE]

A prompt of `--tokens` tokens of the model's default text is prefilled `--rounds` times in each
of three ways, taking turns so the box's drift hits them alike: flashmem with the earlier prompt's
parts attended by the fused flash kernel (`exact_prompt.OnlineSoftmax._add_fused`, this tree),
flashmem with every part by its scores (the kernel switched off: `exact_prompt.FLASH_CPU = None`,
as before stop 58), and a DynamicCache fed the same chunks (`prefill_chunk`, the model's own
SDPA). Prints and writes the median seconds of each, their ratios, and the largest difference
between the two flashmem prefills' last logits.
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
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--config", default="configs/cpu-small.yaml")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the config's prefill_chunk unless given")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    from transformers import DynamicCache

    import flashmem
    from flashmem.cache import exact_prompt
    from flashmem.texts import load_text

    torch.set_num_threads(1)
    model, tokenizer = flashmem.load_model(a.model)
    ids = tokenizer(load_text("default")[: a.tokens * 8], return_tensors="pt").input_ids[:, : a.tokens]
    cfg = flashmem.FlashMemoryConfig.from_yaml(a.config)
    if a.prefill_chunk:
        cfg = cfg.model_copy(update={"prefill_chunk": a.prefill_chunk})
    kernel = exact_prompt.FLASH_CPU
    seconds: dict[str, list[float]] = {"fused": [], "scores": [], "dynamic": []}
    last: dict[str, torch.Tensor] = {}

    def flash(mode: str) -> None:
        exact_prompt.FLASH_CPU = kernel if mode == "fused" else None
        try:
            with flashmem.attach(model, cfg) as cache:
                t0 = time.perf_counter()
                logits = flashmem.prefill(model, cache, ids)
                seconds[mode].append(time.perf_counter() - t0)
                last[mode] = logits[0, -1].float()
        finally:
            exact_prompt.FLASH_CPU = kernel

    def dynamic() -> None:
        cache = DynamicCache()
        t0 = time.perf_counter()
        for s in range(0, ids.shape[1], cfg.prefill_chunk):
            model(ids[:, s : s + cfg.prefill_chunk], cache=cache, use_cache=True, logits_to_keep=1)
        seconds["dynamic"].append(time.perf_counter() - t0)

    with torch.no_grad():
        for r in range(a.rounds):
            order = [lambda: flash("fused"), lambda: flash("scores"), dynamic]
            for run in order[r % 3 :] + order[: r % 3]:
                run()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out: dict[str, Any] = {
        "command": f"python benchmarks/diagnostics/prefill_fused_ab.py --model {a.model} --tokens {a.tokens} "
        f"--rounds {a.rounds} --config {a.config}" + (f" --prefill-chunk {a.prefill_chunk}" if a.prefill_chunk else ""),
        "cpu_kernel": kernel is not None,
        "seconds": seconds,
        "median_s": med,
        "fused_over_scores": med["fused"] / med["scores"],
        "fused_over_dynamic": med["fused"] / med["dynamic"],
        "scores_over_dynamic": med["scores"] / med["dynamic"],
        "last_logits_max_diff": (last["fused"] - last["scores"]).abs().max().item(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(out, indent=1))
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
