"""A model's decode forward with its linear weights laid out [out, in] and [in, out]:

    python benchmarks/diagnostics/linear_layout.py [--model smollm2] [--rows 1,2,4,8]
        [--context 64] [--reps 8] [--prefill 512] [--out FILE]

One torch thread, fp32. For each number of rows (sequences of one new token each, over a
DynamicCache of `--context` tokens, the shape of a batched decode round), the forward's ms
with the weights as PyTorch lays them out (`out_major`) and as `flashmem.models.weight_layout`
lays them out for MKL (`in_major`), the two layouts alternating rep by rep in this one process
(the box's speed moves; only this run's figures are compared), the median of `--reps`. Also one
`--prefill`-token chunk each way (0: skip), and the largest difference of the last logits.

    python benchmarks/diagnostics/linear_layout.py --memory [--model smollm2]

Linux: the process's resident memory (/proc/self/status: anonymous, file-backed, and the peak)
after `load_model` in each layout and after one forward, each layout in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from flashmem.models import load_model
from flashmem.models.weight_layout import set_linear_layout


def forward_ms(model: torch.nn.Module, ids: torch.Tensor, context: int, new: int) -> tuple[float, torch.Tensor]:
    """Prefill ``context`` tokens of ``ids`` (not timed), then time one forward of the ``new`` after them."""
    cache = DynamicCache()
    with torch.no_grad():
        if context:
            model(ids[:, :context], cache=cache, use_cache=True)
        t0 = time.perf_counter()
        out = model(ids[:, context : context + new], cache=cache, use_cache=True)
        return (time.perf_counter() - t0) * 1e3, out.logits[:, -1].float()


def resident_mb() -> dict[str, int]:
    """RssAnon, RssFile, VmRSS and VmHWM (the peak) of this process, MB."""
    keys = ("RssAnon", "RssFile", "VmRSS", "VmHWM")
    lines = Path("/proc/self/status").read_text().splitlines()
    return {k: int(ln.split()[1]) >> 10 for ln in lines for k in keys if ln.startswith(k + ":")}


def memory_child(model_name: str, layout: str) -> None:
    """In a fresh process: load in `layout`, print the resident memory after loading and after a forward."""
    model, _ = load_model(model_name, weight_layout=layout)
    after_load = resident_mb()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    print(json.dumps({"layout": layout, "after_load_mb": after_load, "after_forward_mb": resident_mb()}))


def memory(args: argparse.Namespace) -> None:
    import subprocess
    import sys

    rows = []
    for layout in ("out_major", "in_major"):
        cmd = [sys.executable, __file__, "--model", args.model, "--memory-child", layout]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "memory": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--out")
    ap.add_argument("--memory", action="store_true", help="resident memory after loading, each layout")
    ap.add_argument("--memory-child", choices=["out_major", "in_major"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.memory_child:
        return memory_child(args.model, args.memory_child)
    if args.memory:
        return memory(args)
    model, _ = load_model(args.model, weight_layout="out_major")
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [(r, args.context, 1) for r in rows] + ([(1, 0, args.prefill)] if args.prefill else [])
    ids = {s: torch.randint(0, vocab, (s[0], s[1] + s[2]), generator=g) for s in shapes}
    times: dict[tuple, dict[str, list[float]]] = {s: {"out_major": [], "in_major": []} for s in shapes}
    diff = {s: 0.0 for s in shapes}
    for rep in range(args.reps + 1):  # rep 0 warms both layouts up
        order = ("out_major", "in_major") if rep % 2 else ("in_major", "out_major")
        logits: dict[tuple, dict[str, torch.Tensor]] = {s: {} for s in shapes}
        for layout in order:
            set_linear_layout(model, layout)
            for s in shapes:
                t, logits[s][layout] = forward_ms(model, ids[s], s[1], s[2])
                if rep:
                    times[s][layout].append(t)
        for s in shapes:
            diff[s] = max(diff[s], (logits[s]["in_major"] - logits[s]["out_major"]).abs().max().item())
    out = {"model": args.model, "threads": 1, "reps": args.reps, "rows": []}
    for s in shapes:
        a, b = statistics.median(times[s]["out_major"]), statistics.median(times[s]["in_major"])
        row = {
            "rows": s[0],
            "context": s[1],
            "new_tokens": s[2],
            "out_major_ms": round(a, 2),
            "in_major_ms": round(b, 2),
            "in_over_out": round(b / a, 3),
            "max_logit_diff": diff[s],
        }
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
