"""Issue 3's benchmark target on SmolLM2 at 8K, full cache measured in the same run.

Prefill P tokens of the real text, then decode the next N tokens one at a time
(teacher-forced on the text), through flashmem and through DynamicCache,
alternating the two caches step by step so that machine noise hits both alike.
Prints, over the N decoded positions: mean KL(full || flashmem), top-1
agreement, the measured device-resident ratio (working set included; its peak
over the run, which holds an exact prompt's K/V during the prompt, and over
the decode steps) and decode ms/token of each, with their ratio.

    python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 1000
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache

import flashmem
from flashmem.metrics import kl_per_token
from flashmem.texts import load_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cpu-small.yaml")
    ap.add_argument("--prompt", type=int, default=7192, help="prefill tokens")
    ap.add_argument("--decode", type=int, default=1000, help="decoded (scored) tokens")
    ap.add_argument("--offset", type=int, default=200_000, help="character offset into the text")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = flashmem.FlashMemoryConfig.from_yaml(args.config)
    model, tok = flashmem.load_model("smollm2")
    P, N = args.prompt, args.decode
    text = load_text("default")[args.offset : args.offset + (P + N) * 8]
    ids = tok(text, return_tensors="pt").input_ids[:, : P + N]
    if ids.shape[1] < P + N:
        raise SystemExit("text too short for --prompt + --decode")

    fm = flashmem.attach(model, cfg)  # unmanaged caches fall through to SDPA
    full = DynamicCache(config=model.config)
    lp = {"flashmem": [], "full": []}
    spent = {"flashmem": 0.0, "full": 0.0}
    decode_peak = 0
    with torch.no_grad():
        prefill = {}
        for name, cache in (("full", full), ("flashmem", fm)):
            t0 = time.perf_counter()
            out = model(ids[:, :P], cache=cache, use_cache=True, logits_to_keep=1)
            prefill[name] = time.perf_counter() - t0
            lp[name].append(out.logits[0, -1].float().log_softmax(-1))
        for i in range(P, P + N - 1):
            for name, cache in (("full", full), ("flashmem", fm)) if i % 2 else (("flashmem", fm), ("full", full)):
                t0 = time.perf_counter()
                out = model(ids[:, i : i + 1], cache=cache, use_cache=True)
                spent[name] += time.perf_counter() - t0
                lp[name].append(out.logits[0, -1].float().log_softmax(-1))
                if cache is fm:  # resident while decoding (the peak also holds an exact prompt's K/V)
                    decode_peak = max(decode_peak, fm.memory_report()["managed_resident_bytes"])
    ref, got = torch.stack(lp["full"]), torch.stack(lp["flashmem"])
    kl = kl_per_token(ref, got)
    agree = (ref.argmax(-1) == got.argmax(-1)).float()
    report = fm.memory_report()
    full_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in full.layers)
    steps = N - 1
    result = {
        "config": args.config,
        "prompt_tokens": P,
        "decoded_tokens": N,
        "kl_mean": float(kl.mean()),
        "kl_p95": float(kl.quantile(0.95)),
        "top1_agree": float(agree.mean()),
        "resident_ratio": report["device_resident_bytes"] / full_bytes,
        "peak_resident_ratio": report["peak_managed_resident_bytes"] / full_bytes,
        "decode_peak_resident_ratio": decode_peak / full_bytes,
        "cold_bytes": report["cold_bytes"],
        "full_cache_bytes": full_bytes,
        "prefill_s": prefill,
        "decode_ms_per_token": {k: 1000 * v / steps for k, v in spent.items()},
        "decode_time_ratio_flashmem_over_full": spent["flashmem"] / spent["full"],
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
