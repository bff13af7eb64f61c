"""Bytes of a stored prefix, and where a reused request's time goes (SmolLM2, the recipe).

For each document length: one engine with a fresh prefix folder runs the prompt
(a King James document and a question, greedy) cold, which stores its prefix
records; then the same prompt again, reused. Reported per length:

- bytes: the folder's bytes and record count after the cold request (the stored
  document), and bytes per 1K stored tokens;
- ttft: time to first token, cold and reused, and their ratio;
- where the reused request's time goes: loading the records (read + checks +
  decode), rebuilding the cache from them, the re-prefilled tail (the prompt
  after the last stored record: its last END_TAIL tokens with the engine's end
  records, the default; up to a whole block with `--no-end-records`) and the
  rest (sampling, bookkeeping);
- same answer: the greedy tokens of the two requests, and whether they are equal.

Runs on the engine directly (`Engine.run_sync`, no HTTP), so the numbers are the
worker's own. One model load; heavy: run it under the shared lock.

    OMP_NUM_THREADS=1 python benchmarks/prefix_bytes.py --tokens 3072 8192 \
        --out results/prefix_bytes_smollm2_end.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "\n\nQuestion: Who is named first in the passage above, and what does he do?\nAnswer:"


def timed(obj: Any, name: str, into: dict[str, float]) -> None:
    """Wrap obj.name so its seconds add up in into[name]."""
    fn = getattr(obj, name)

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def run_length(
    model: Any, tok: Any, cfg: Any, n_tokens: int, max_tokens: int, store_kw: dict[str, Any], end_records: bool
) -> dict:
    from flashmem.serve import state
    from flashmem.serve.engine import Engine, Sampling, Sequence
    from flashmem.serve.prefix import PrefixStore
    from flashmem.texts import haystack

    doc = haystack(tok, n_tokens - 40, seed=3, name="kjv")
    ids = tok(doc + QUESTION, add_special_tokens=False)["input_ids"]
    out: dict[str, Any] = {"prompt_tokens": len(ids)}
    with tempfile.TemporaryDirectory() as d:
        store = PrefixStore(d, **store_kw)
        engine = Engine(model, tok, cfg, model_name="smollm2", prefix_store=store, end_records=end_records)
        spent: dict[str, float] = {}
        timed(store, "load", spent)
        timed(store, "save", spent)
        timed(state, "import_records", spent)
        timed(state, "export_delta", spent)
        forwards: list[tuple[int, float]] = []
        fwd = engine._forward

        def forward(seq: Any, chunk: list[int]) -> torch.Tensor:
            t0 = time.perf_counter()
            r = fwd(seq, chunk)
            forwards.append((len(chunk), time.perf_counter() - t0))
            return r

        engine._forward = forward  # type: ignore[method-assign]
        runs = {}
        for name in ("cold", "reused"):
            spent.clear()
            forwards.clear()
            seq = Sequence(ids, Sampling(max_tokens=max_tokens, temperature=0), "bench", None)
            t0 = time.perf_counter()
            engine.run_sync(seq)
            assert seq.t_first is not None, seq.finish_reason
            ttft = seq.t_first - t0
            prompt_fwd = [t for n, t in forwards if n > 1]
            runs[name] = {
                "ttft_s": round(ttft, 3),
                "reused_tokens": seq.reused_tokens,
                "load_s": round(spent.get("load", 0.0), 3),
                "import_s": round(spent.get("import_records", 0.0), 3),
                "export_s": round(spent.get("export_delta", 0.0), 3),
                "save_s": round(spent.get("save", 0.0), 3),
                "prefill_chunks": len(prompt_fwd),
                "prefill_s": round(sum(prompt_fwd), 3),
                "chunk_s": [round(t, 3) for t in prompt_fwd],
                "tail_tokens": len(ids) - seq.reused_tokens,
                "generated": seq.generated,
            }
            if name == "cold":
                out["stored_bytes"] = store.nbytes()
                out["stored_records"] = len(store)
            else:  # what the stored records cover: the tokens the reused request restored
                out["stored_tokens"] = seq.reused_tokens
        r, c = runs["reused"], runs["cold"]
        r["other_s"] = round(r["ttft_s"] - r["load_s"] - r["import_s"] - r["prefill_s"], 3)
        out["cold"], out["reused"] = c, r
        out["ttft_ratio"] = round(r["ttft_s"] / c["ttft_s"], 4)
        out["same_greedy_tokens"] = c["generated"] == r["generated"]
        out["bytes_per_1k_tokens"] = round(out["stored_bytes"] / (out["stored_tokens"] / 1024))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--codec", default=None, help="prefix record codec (a PrefixStore keyword where it has one)")
    p.add_argument("--config", default=str(ROOT / "configs" / "cpu-small.yaml"))
    p.add_argument(
        "--no-end-records",
        action="store_true",
        help="the engine without end records (Engine(end_records=False)): full blocks only",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    import flashmem
    from flashmem.config import FlashMemoryConfig

    cfg = FlashMemoryConfig.from_yaml(args.config)
    model, tok = flashmem.load_model("smollm2")
    store_kw = {"codec": args.codec} if args.codec else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit.strip(),
        "model": "smollm2 (fp32)",
        "config": Path(args.config).name,
        "codec": args.codec or "default",
        "end_records": not args.no_end_records,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "lengths": [],
    }
    for n in args.tokens:
        r = run_length(model, tok, cfg, n, args.max_tokens, store_kw, not args.no_end_records)
        report["lengths"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("cold", "reused")}), flush=True)
        print("  cold  ", json.dumps(r["cold"]), flush=True)
        print("  reused", json.dumps(r["reused"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
