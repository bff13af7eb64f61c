"""How many operators a decode step dispatches, per layer, and how many of them wait on the device.

On a GPU, eager PyTorch pays a fixed host cost for every operator it launches (a few
microseconds, whatever the tensor's size), and an operator whose result the host reads
(`.item()`, `.tolist()`, `nonzero`, `unique`, a copy to the host) makes the host wait for the
device's queue. This counts, for one decode step of a random-weight model with Llama-3.1-8B's
attention geometry (32 query heads and 8 KV heads of 128; small hidden size, a few layers: the
counts do not depend on them), the ATen operators each cache's step dispatches per layer:
kernels (every operator that is not a view), views, and host waits. flashmem runs the path it
takes on an accelerator (ranked on the host, `BlockReader.rank_on_host`) with the config an
accelerator gets for the budget and length (`budget_config(..., device_codes=True)`).

    python benchmarks/diagnostics/ops_per_step.py --tokens 16384 --budget 0.0625 --out results/ops_per_step.json

With `--select-every N` past `--steps`, the counted steps reuse the warm-up step's selection
(`lsa_select_every`): what a step between two selections dispatches. `--by-caller N` also prints
flashmem's N busiest functions: the kernels each dispatches itself (the innermost flashmem frame
on the stack), per layer, which is where fusing or capturing a step would start.

The counts come from this CPU; on CUDA the same Python code dispatches the same operators,
except where a path is CUDA-only (the prefetcher's staged copies). The hardware model's
dispatch term (`flashmem.sizing.hardware`, `Assumptions.op_overhead_s`) takes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashmem
from flashmem.cache.block_reads import BlockReader
from flashmem.sizing.budget import budget_config, model_geometry
from flashmem_eval.live_bytes import caller
from flashmem_eval.tiny import build_llama

GEOMETRY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=512,
    rope_theta=500000.0,
)
# operators the host must wait on the device for: their result is read on the host (and
# indexing by a boolean mask, `_bool_mask`)
WAITS = ("_local_scalar_dense", "nonzero", "unique", "_unique", "is_nonzero", "equal", "masked_select")


class Count(TorchDispatchMode):
    def __init__(self, by_caller: bool = False) -> None:
        super().__init__()
        self.kinds: Counter[str] = Counter()
        self.names: Counter[str] = Counter()
        self.callers: Counter[str] | None = Counter() if by_caller else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.names[name] += 1
        if any(w == name or name.startswith(w) for w in WAITS) or _bool_mask(name, args):
            self.kinds["waits"] += 1
        if torch.Tag.view_copy in func.tags or func.is_view or name in ("detach", "alias", "_unsafe_view"):
            self.kinds["views"] += 1
        else:
            self.kinds["kernels"] += 1
            if self.callers is not None:
                self.callers[caller()] += 1
        if name in ("_to_copy", "copy_") and _crosses(args, kwargs):
            self.kinds["device_copies"] += 1
        return func(*args, **(kwargs or {}))


def _bool_mask(name: str, args: Any) -> bool:
    """Indexing by a boolean mask: its result's size depends on the mask's values, which the host
    must read from the device (a nonzero inside the operator)."""
    if name not in ("index", "index_put", "index_put_") or len(args) < 2:
        return False
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1] if t is not None)


def _crosses(args: Any, kwargs: Any) -> bool:
    """A copy between two devices (on a CPU run every tensor is on the CPU: never)."""
    devs = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    dev = (kwargs or {}).get("device")
    return len(devs) > 1 or (dev is not None and torch.device(dev).type not in devs)


def step_counts(model: Any, cache: Any, ids: torch.Tensor, steps: int, by_caller: int = 0) -> dict[str, Any]:
    """Prefill ids into cache, then `steps` decode steps counted -> medians per step and layer
    (with by_caller, the `by_caller` functions that dispatch most kernels, mean per step and layer)."""
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        if isinstance(cache, flashmem.FlashMemoryCache):
            logits = flashmem.prefill(model, cache, ids)
        else:
            logits = model(ids, past_key_values=cache, use_cache=True).logits
        nxt = logits[:, -1:].argmax(-1)
        model(nxt, past_key_values=cache, use_cache=True)  # one step uncounted (first selection)
        per: list[Counter[str]] = []
        callers: Counter[str] = Counter()
        for _ in range(steps):
            with Count(by_caller > 0) as c:
                out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            per.append(c.kinds)
            callers.update(c.callers or {})
    keys = ("kernels", "views", "waits", "device_copies")
    out_: dict[str, Any] = {k: statistics.median(p[k] for p in per) / layers for k in keys}
    if by_caller:
        out_["kernels_by_caller"] = {k: n / steps / layers for k, n in callers.most_common(by_caller)}
    return out_


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--budget", type=float, default=0.0625)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device-codes", action="store_true", help="the re-rank's int4 codes held on the device")
    ap.add_argument(
        "--select-every", type=int, default=1,
        help="lsa_select_every; with a value past --steps every counted step reuses the warm-up step's selection",
    )  # fmt: skip
    ap.add_argument("--by-caller", type=int, default=0, metavar="N", help="list the N busiest functions")
    ap.add_argument(
        "--static", action="store_true",
        help="decode_step: static (cache/static_step.py), with lsa_rerank 1 (with --device-codes: re-ranked by "
        "int4 codes held on the device, no page cache); also counts the eager step with that config in the "
        "same run",
    )  # fmt: skip
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build_llama(0, "sdpa", num_hidden_layers=a.layers, max_position_embeddings=1 << 18, **GEOMETRY).to(
        torch.bfloat16
    )
    ids = torch.randint(0, GEOMETRY["vocab_size"], (1, a.tokens), generator=torch.Generator().manual_seed(0))
    from transformers import DynamicCache

    rows: dict[str, Any] = {"tokens": a.tokens, "budget": a.budget, "layers": a.layers, "steps": a.steps}
    rows["full_cache"] = step_counts(model, DynamicCache(), ids, a.steps, a.by_caller)
    was = BlockReader.rank_on_host
    BlockReader.rank_on_host = True  # the accelerator's path
    try:
        # the config an accelerator gets (budget_config(device_codes=True): no host key copy, the
        # candidates' codes on the device where the page cap leaves room), its 4,096-token chunks
        extra = {"lsa_rerank_codec": "int4", "lsa_rerank_on_device": True} if a.device_codes else {}
        if a.static:
            extra = (
                {"lsa_rerank": 1} if not a.device_codes else {**extra, "lsa_cache_pages": 0, "lsa_rerank_min_pages": 0}
            )
            extra["rest_entry"] = False  # the static step has none; the eager row compared runs the same config
        cfg = budget_config(
            a.budget, a.tokens + a.steps + 2, **model_geometry(model), device_codes=True,
            lsa_layer_shares=None, prefill_chunk=4096, lsa_select_every=a.select_every, **extra,
        )  # fmt: skip
        cache = flashmem.attach(model, cfg)
        rows["flashmem"] = step_counts(model, cache, ids, a.steps, a.by_caller)
        if a.static:
            cache.close()
            cache = flashmem.attach(model, cfg.model_copy(update={"decode_step": "static"}))
            rows["flashmem_static"] = step_counts(model, cache, ids, a.steps, a.by_caller)
        rows["config"] = {
            k: getattr(cfg, k)
            for k in (
                "lsa_top_k",
                "lsa_rerank_codec",
                "lsa_rerank_on_device",
                "lsa_rerank_mirror",
                "lsa_cache_pages",
                "lsa_select_every",
                "decode_step",
            )
        }
        cache.close()
    finally:
        BlockReader.rank_on_host = was
    print(json.dumps(rows, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
