"""Ablations of the cache's design choices on SmolLM2, one JSON line per variant.

The full-cache logits come from one forward over prompt + continuation; each
variant prefills the prompt through flashmem and decodes the continuation one
token at a time (teacher-forced), so selection runs per token as in real decode.

    python benchmarks/diagnostics/ablate_fidelity.py --prompt 4096 --decode 256 \
        --base '{"gpu_cache_limit":128,"hca_chunk_size":32,"csa_band_tokens":256,"lsa_top_k":4}' \
        --variants '[{}, {"summary_bias":"log_size"}, {"use_summaries":false}]'
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import flashmem
from flashmem.metrics import kl_per_token
from flashmem.sizing.budget import full_kv_bytes
from flashmem.texts import load_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--offset", type=int, default=200_000, help="character offset into the text")
    ap.add_argument("--base", default="{}", help="JSON config keys shared by every variant")
    ap.add_argument("--variants", default="[{}]", help="JSON list of config keys laid over --base")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--plain-chunks",
        action="store_true",
        help="ablation: prefill in plain chunks (no separate selection for the prompt's tail)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base, variants = json.loads(args.base), json.loads(args.variants)
    if args.plain_chunks:
        base["prefill_split_tail"] = False

    model, tok = flashmem.load_model("smollm2")
    P, N = args.prompt, args.decode
    ids = tok(load_text("default")[args.offset : args.offset + (P + N) * 8], return_tensors="pt").input_ids
    ids = ids[:, : P + N]
    with torch.no_grad():
        full = model(ids).logits[0, P - 1 : P + N - 1].float().log_softmax(-1)
    full_bytes = full_kv_bytes(model, P + N - 1, model.dtype.itemsize)["total_bytes"]
    for var in variants:
        keys = {**base, **var}
        cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**keys))
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(ids[:, :P], cache=cache, use_cache=True, logits_to_keep=1)
            t_prefill = time.perf_counter() - t0
            rows = [out.logits[0, -1]]
            t0 = time.perf_counter()
            for i in range(P, P + N - 1):
                rows.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1])
            t_decode = time.perf_counter() - t0
        lp = torch.stack(rows).float().log_softmax(-1)
        kl = kl_per_token(full, lp)
        report = cache.memory_report()
        print(
            json.dumps(
                {
                    "variant": var,
                    "kl_mean": round(float(kl.mean()), 4),
                    "top1_agree": round(float((lp.argmax(-1) == full.argmax(-1)).float().mean()), 4),
                    "resident_ratio": round(report["device_resident_bytes"] / full_bytes, 4),
                    "prefill_s": round(t_prefill, 1),
                    "decode_ms": round(1000 * t_decode / max(1, N - 1), 1),
                }
            ),
            flush=True,
        )
        cache.close()
        model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()
