"""How far a batched row's logits are from the same row alone, beside how far the dtype's are
from fp32's, on the serve load test's chat prompts (one torch thread):

    python benchmarks/diagnostics/batch_logits.py [--model smollm2] [--dtype bfloat16] [--rows 8]
        [--steps 12] [--out FILE]

1. `batched_vs_alone`: `--rows` chat prompts (serve_load.py's --mode batch prompts; with
   `--context N`, N-token documents of `--text` from seed `--seed` on, with a question) prefilled
   into their own caches, then `--steps` decode steps of all rows in one forward
   (`cache/batched.py`), each row's token also fed to a copy of its cache alone: the largest
   |logit difference| and how often the argmax differs (the same tokens fed to both).
2. `dtype_vs_float32` (a dtype other than float32): each prompt alone in the dtype and in fp32,
   fp32's greedy tokens fed to both: the same two figures. What the dtype's own rounding moves.

With fp32 a batch gives each row its logits alone to fp32 rounding (tests/test_batched_cache.py);
a bf16 row's logits move with the batch's shapes as bf16 rounding moves them, and where an
argmax flips greedy answers part (serve_load.py's `answers_same_of_all`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import flashmem  # noqa: E402
from flashmem.cache.batched import BatchedCache, forward  # noqa: E402
from flashmem.cli.run_cmd import sized_default_config  # noqa: E402
from flashmem.config import FlashMemoryConfig  # noqa: E402
from flashmem.serve.app import chat_prompt_ids  # noqa: E402
from serve_load import BATCH_PROMPTS  # noqa: E402


def feed(model: Any, cache: Any, tokens: list[int]) -> torch.Tensor:
    """A forward of `tokens` alone -> the logits after the last one [vocab] (fp32)."""
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def config_for(model: Any, dtype: str) -> FlashMemoryConfig:
    """The config `flashmem serve` uses without --config (cli/serve_cmd.py)."""
    if dtype == "float32":
        return FlashMemoryConfig.from_yaml(ROOT / "configs" / "cpu-small.yaml")
    return sized_default_config(model)


def batched_vs_alone(model: Any, cfg: FlashMemoryConfig, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    rows = [flashmem.attach(model, cfg) for _ in prompts]
    last = [feed(model, c, p) for c, p in zip(rows, prompts)]
    alone = [flashmem.attach(model, cfg) for _ in prompts]
    for c, p in zip(alone, prompts):
        feed(model, c, p)
    worst, flips, n = 0.0, 0, 0
    for _ in range(steps):
        toks = [int(x.argmax()) for x in last]
        out = forward(model, BatchedCache(rows), [[t] for t in toks])
        for r, x in enumerate(out):
            assert x is not None
            ref = feed(model, alone[r], [toks[r]])
            worst = max(worst, (x - ref).abs().max().item())
            flips += int(x.argmax() != ref.argmax())
            n += 1
            last[r] = x
    return {"max_abs_logit_diff": worst, "argmax_differs": flips, "of": n}


def dtype_vs_float32(
    model: Any, cfg: FlashMemoryConfig, fp32: Any, cfg32: FlashMemoryConfig, prompts: list[list[int]], steps: int
) -> dict[str, Any]:
    worst, flips, n = 0.0, 0, 0
    for p in prompts:
        a, b = flashmem.attach(fp32, cfg32), flashmem.attach(model, cfg)
        la, lb = feed(fp32, a, p), feed(model, b, p)
        for _ in range(steps):
            worst = max(worst, (la - lb).abs().max().item())
            flips += int(la.argmax() != lb.argmax())
            n += 1
            t = int(la.argmax())
            la, lb = feed(fp32, a, [t]), feed(model, b, [t])
    return {"max_abs_logit_diff": worst, "argmax_differs": flips, "of": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--context", type=int, default=0,
        help="N-token documents of --text (seeds --seed..) with a question as the prompts, not the chat prompts",
    )  # fmt: skip
    ap.add_argument("--text", default="stdlib-doc", help="--context: the packaged text (flashmem.texts)")
    ap.add_argument("--seed", type=int, default=20, help="--context: the first document's seed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = flashmem.load_model(args.model, dtype=getattr(torch, args.dtype))
    cfg = config_for(model, args.dtype)
    if args.context:  # documents with sealed blocks: rows that select pages, each its own step
        from flashmem.texts import haystack

        ask = "\n\nWhat does the text above describe? Answer briefly."
        contents = [haystack(tok, args.context, seed=args.seed + i, name=args.text) + ask for i in range(args.rows)]
    else:
        contents = [BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(args.rows)]
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": c}]) for c in contents]
    result: dict[str, Any] = {
        "command": "python benchmarks/diagnostics/batch_logits.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "batched_vs_alone": batched_vs_alone(model, cfg, prompts, args.steps),
    }
    if args.dtype != "float32":
        fp32, _ = flashmem.load_model(args.model)
        result["dtype_vs_float32"] = dtype_vs_float32(
            model, cfg, fp32, config_for(fp32, "float32"), prompts, args.steps
        )
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
