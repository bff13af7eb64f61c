"""How a loaded model's linear weights lie in memory, for the CPU's matrix products.

``nn.Linear`` keeps W as [out, in] and computes x @ W.T. With MKL on an x86 CPU, an
fp32 x @ W.T of a few rows runs as one pass over W per three rows (1-3 rows cost one
pass, 4-6 two, 7-9 three); a batched decode round has one row per sequence. The
same product with W held as [in, out] (W.T made contiguous and seen through a
transposed view, so the module's weight keeps its [out, in] shape and values) is one
GEMM over W. ``benchmarks/diagnostics/linear_layout.py`` measures both on a model.

Only the memory order changes: no weight is copied twice (one matrix at a time is
re-laid), tied weights stay tied, and a product's result differs from the default
layout's by rounding only (another summation order).

``onednn`` keeps the weights as ``auto`` lays them and adds a copy of each in oneDNN's
blocked layout, which products of two rows or more take where they measure faster
(``flashmem.models.onednn_linears``): the linear weights' bytes once more, so ``auto`` never
picks it.
"""

from __future__ import annotations

import platform
from typing import Any

__all__ = ["LAYOUTS", "auto_layout", "linear_layout", "set_linear_layout"]

# out_major: PyTorch's [out, in]; in_major: stored [in, out]; onednn: auto's order plus oneDNN's copy
LAYOUTS = ("out_major", "in_major", "onednn")


def auto_layout(model: Any) -> str:
    """``in_major`` for an fp32 model on an x86 CPU whose torch uses MKL, else ``out_major``.

    bf16 products go to oneDNN (AMX where the CPU has it), which is faster with the
    default layout; CUDA and other BLAS libraries are left as PyTorch lays them out.
    """
    import torch

    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return "out_major"
    if not torch.backends.mkl.is_available() or platform.machine().lower() not in ("x86_64", "amd64"):
        return "out_major"
    return "in_major"


def linear_layout(model: Any) -> str:
    """The layout of the model's linear weights: ``onednn`` if every one has oneDNN's copy,
    ``in_major`` if every one is stored so, else ``out_major``."""
    from flashmem.models import onednn_linears

    if onednn_linears.is_packed(model):
        return "onednn"
    ws = [m.weight for m in model.modules() if _plain(m)]
    return "in_major" if ws and all(_is_in_major(w) for w in ws) else "out_major"


def set_linear_layout(model: Any, layout: str) -> int:
    """Lay every plain ``nn.Linear`` weight of ``model`` out as ``layout``; returns how many changed
    (re-laid, or given or relieved of oneDNN's copy)."""
    import torch

    from flashmem.models import onednn_linears

    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "onednn":
        if not onednn_linears.available():
            raise ValueError("weight layout onednn needs a torch built with oneDNN (mkldnn); this one is not")
        p = next(model.parameters(), None)
        if p is None or p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
            where = "no weights" if p is None else f"{p.dtype} weights on {p.device.type}"
            raise ValueError(f"weight layout onednn is for float32 or bfloat16 weights on a CPU; the model has {where}")
        if onednn_linears.is_packed(model):
            return 0
        # the dense weights as auto lays them (the one-row products read them), then the copies
        return set_linear_layout(model, auto_layout(model)) + onednn_linears.pack(model)
    unpacked = onednn_linears.unpack(model)
    seen: set[int] = set()
    changed = 0
    with torch.no_grad():
        for m in model.modules():
            if not _plain(m) or id(m.weight) in seen:
                continue
            seen.add(id(m.weight))  # a tied weight (lm_head / embeddings) is one Parameter
            w = m.weight.data
            if _is_in_major(w) == (layout == "in_major"):
                continue
            m.weight.data = w.t().contiguous().t() if layout == "in_major" else w.contiguous()
            changed += 1
        if changed:
            # The weights may be views of one file mapping (safetensors loads zero-copy): while any
            # parameter still points into it, the mapping, and every page of it the re-layout
            # read, stays in the process (SmolLM2: 1.5 GB resident instead of 1.0). So the rest
            # (norms, and weights left alone) get their own memory too, and the mapping goes.
            for q in model.parameters():
                if id(q) not in seen:
                    q.data = q.data.clone()
    return changed + unpacked


def _plain(m: Any) -> bool:
    """A plain ``nn.Linear`` with a floating weight: quantized linears (subclasses, packed or
    integer weights) compute from their own layouts and are left alone."""
    import torch

    w = getattr(m, "weight", None)
    return type(m) is torch.nn.Linear and type(w) is torch.nn.Parameter and w.is_floating_point()


def _is_in_major(w: Any) -> bool:
    # [out, in] seen through a transpose of a contiguous [in, out]
    return w.dim() == 2 and w.stride() == (1, w.shape[0]) and w.shape[0] > 1
