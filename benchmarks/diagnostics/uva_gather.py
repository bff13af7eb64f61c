"""Cold pages read by the device itself: a gather from pinned host memory with no host wait.

The H200 run (docs/accelerator.md, "The first run on an H200") found flashmem's decode step
bound by the host: about 63 us of Python per kernel and 63 synchronisations a step, against
0.85 us per kernel replayed from a CUDA graph. A step can be captured only if it never waits on
the device, and today the page ids go to the host so that the host can cut the pages out of
the cold tier and copy them over. Pinned host memory is addressable by the device (CUDA's
unified addressing), so a kernel can gather the pages straight from it over the link, given
page ids that stay on the device. This measures that against today's way, at decode sizes:

- `copy`: ids to the host (a wait), the pages cut there into a pinned buffer, one copy to the
  device (what `BlockReader` does on CUDA);
- `mapped`: the pinned pool seen as a CUDA tensor at the same address (unified addressing;
  through CuPy's `UnownedMemory` and DLPack: PyTorch has no public call for it), `index_select`
  with the ids on the device;
- `mapped_graph`: the same captured in a CUDA graph and replayed with new ids written into
  its static id tensor: what a captured decode step would run.

Per row: pages of `--page-kb` (4 KB: 16 tokens of one KV head x 128, bf16) out of a pool of
`--pool-mb`, GB/s of page bytes and us per gather (median of `--reps`), and that the three
agree. On a CPU only `copy` runs (a smoke test of the script).

    python benchmarks/diagnostics/uva_gather.py --pool-mb 256 --out results/uva_gather_h200.json

On the H200 (2026-12-04): 1,024 pages in 262 us by copy, 109 us mapped, 108 us from a graph.
    python benchmarks/diagnostics/uva_gather.py --device cpu --pages 64 --pool-mb 8 --out /tmp/uva.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

# src/: a checkout without `pip install -e .` (the lent GPU machine)
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

from flashmem.store.mapped import mapped_view  # noqa: E402


def timed(fn: Callable[[], Any], reps: int, device: torch.device) -> list[float]:
    """us per call of fn, each call synchronised (the first, a warm-up, dropped)."""
    out = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def row(pages: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    page_bytes = args.page_kb * 1024
    n_pool = args.pool_mb * 2**20 // page_bytes
    pool = torch.empty(n_pool, page_bytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    pool.copy_(torch.randn(n_pool, page_bytes // 2, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(pages)
    ids_host = torch.randperm(n_pool, generator=g)[:pages].sort().values
    ids_dev = ids_host.to(device)
    staged = torch.empty(pages, page_bytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    res: dict[str, Any] = {"pages": pages, "page_bytes": page_bytes, "pool_bytes": n_pool * page_bytes}
    ref = pool.index_select(0, ids_host)

    def copy() -> torch.Tensor:
        ids = ids_dev.cpu()  # the host needs the ids: a wait on the device
        torch.index_select(pool, 0, ids, out=staged)
        return staged.to(device, non_blocking=True)

    variants: dict[str, Callable[[], torch.Tensor]] = {"copy": copy}
    if device.type == "cuda":
        try:
            view = mapped_view(pool)
            variants["mapped"] = lambda: view.index_select(0, ids_dev)
            static_ids = ids_dev.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                view.index_select(0, static_ids)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_out = view.index_select(0, static_ids)

            def replay() -> torch.Tensor:
                static_ids.copy_(ids_dev)  # the step's new ids, written on the device
                graph.replay()
                return graph_out

            variants["mapped_graph"] = replay
        except Exception as exc:  # recorded: the copy path still runs
            res["mapped_error"] = f"{type(exc).__name__}: {exc}"
            res["trace"] = traceback.format_exc(-3)
    for name, fn in variants.items():
        us = timed(fn, args.reps, device)
        got = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        res[name] = {
            "us_median": statistics.median(us),
            "gb_per_s": pages * page_bytes / statistics.median(us) / 1e3,
            "equal": bool(torch.equal(got.cpu(), ref)),
        }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the copy path only)")
    ap.add_argument("--pages", default="64,256,1024,4096", help="pages per gather, comma-separated")
    ap.add_argument("--page-kb", type=int, default=4, help="KiB per page (default 4)")
    ap.add_argument("--pool-mb", type=int, default=1024, help="MiB of pinned pool (default 1024)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here; allowed: --device cpu", file=sys.stderr)
        return 2
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": [],
    }
    for pages in (int(x) for x in args.pages.split(",")):
        r = row(pages, args, device)
        out["rows"].append(r)
        cells = [f"{k} {v['us_median']:.0f} us ({v['gb_per_s']:.1f} GB/s{'' if v['equal'] else ', WRONG'})"
                 for k, v in r.items() if isinstance(v, dict)]  # fmt: skip
        print(
            f"{pages:>5} pages: " + "; ".join(cells) + (f"; mapped: {r['mapped_error']}" if "mapped_error" in r else "")
        )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
