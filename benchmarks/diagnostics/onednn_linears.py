"""A model's linear products at several row counts: MKL/BLAS over the dense weights (PyTorch's
[out, in] and `in_major`'s [in, out]) against oneDNN's reordered copy (`weight_layout: onednn`,
flashmem.models.onednn_linears), one shape at a time, one torch thread:

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/onednn_linears.py --rows 1,2,4,8,64,512 --out r.json

For each distinct (in, out) shape of the model's plain linears, and each row count: the median
ms of one product, times how many linears of that shape the model has (so a row of the table
is what one forward of that many rows spends there), the products' largest difference from
the [out, in] one, and the process's resident bytes before and after reordering every weight.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F

from flashmem.models import load_model
from flashmem.models.onednn_linears import PACK_ROWS
from flashmem.models.weight_layout import _plain
from flashmem_eval.benchkit import cpu_name, median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", default="1,2,4,8,64,512")
    ap.add_argument("--reps", type=int, default=9, help="timed calls per product (the median kept)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model, weight_layout="out_major")
    shapes = Counter((m.in_features, m.out_features) for m in model.modules() if _plain(m))
    rows = [int(r) for r in args.rows.split(",")]
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    packed = {}
    with torch.inference_mode():
        for m in model.modules():
            if _plain(m):
                packed[id(m)] = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_ROWS)
        rss1 = proc.memory_info().rss
        table = []
        firsts = {}
        for m in model.modules():
            if _plain(m):
                firsts.setdefault((m.in_features, m.out_features), m)
        g = torch.Generator().manual_seed(0)
        for (i, o), n in shapes.items():
            m = firsts[(i, o)]
            w = m.weight.detach()
            wt = w.t().contiguous().t()  # in_major: [in, out] stored, seen as [out, in]
            p = packed[id(m)]
            for r in rows:
                x = torch.randn(r, i, generator=g)
                ref = F.linear(x, w)
                ways = {
                    "out_major": lambda x=x, w=w: F.linear(x, w),
                    "in_major": lambda x=x, wt=wt: F.linear(x, wt),
                    "onednn": lambda x=x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                }
                row: dict[str, Any] = {"in": i, "out": o, "linears": n, "rows": r}
                for name, fn in ways.items():
                    row[f"{name}_ms_all"] = median_ms(fn, args.reps) * n
                    row[f"{name}_max_diff"] = (fn() - ref).abs().max().item()
                table.append(row)
                print(
                    f"{i:5d}x{o:<6d} x{n:<3d} rows {r:4d}: out_major {row['out_major_ms_all']:8.2f}  "
                    f"in_major {row['in_major_ms_all']:8.2f}  onednn {row['onednn_ms_all']:8.2f} ms",
                    flush=True,
                )
    totals = {
        r: {
            name: sum(t[f"{name}_ms_all"] for t in table if t["rows"] == r)
            for name in ("out_major", "in_major", "onednn")
        }
        for r in rows
    }
    for r, t in totals.items():
        print(f"all linears, {r} rows: " + "  ".join(f"{k} {v:.2f} ms" for k, v in t.items()))
    weight_bytes = sum(m.weight.nbytes for m in model.modules() if _plain(m))
    out = {
        "command": "python benchmarks/diagnostics/onednn_linears.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "torch_threads": 1,
        "cpu": cpu_name(),
        "pack_rows": PACK_ROWS,
        "linear_weight_bytes": weight_bytes,
        "rss_added_by_reordering": rss1 - rss0,
        "table": table,
        "totals_ms": {str(r): t for r, t in totals.items()},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"reordering every linear weight added {(rss1 - rss0) / 1e6:.1f} MB resident ({weight_bytes / 1e6:.1f} MB of weights)"
    )
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
