"""A second copy of each linear weight in oneDNN's own layout, for products of several rows.

`weight_layout: onednn` (``flashmem.models.weight_layout``). A batched decode round multiplies
every linear weight by one row per sequence, and a prompt chunk by one row per token. In fp32
on an AMD EPYC (Zen 4), one thread, MKL's product over the weights as `in_major` lays them
took 33.9 ms for 8 rows of SmolLM2's output head (49,152 x 576) against 6.4 ms for one row,
while oneDNN's product with the weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the prepacking PyTorch's inductor does for CPU
linears) took 10.0 ms; over all of SmolLM2's linears, 8 rows took 30.8 ms against 63.4, and a
512-token prompt chunk 1.33 s against 1.62 s. One row stays faster through MKL (14.0 against
19.3 ms; `benchmarks/diagnostics/onednn_linears.py`, results/onednn_linears_smollm2_epyc.json).

So each plain ``nn.Linear`` keeps its weight (in the order `auto` gives it: the one-row products,
the tied embedding, fingerprints and saving read it) and gets the reordered copy beside it.
For an input of two rows or more (no autograd, a CPU, the weight's dtype) the first calls of
each size (in and out features, rows rounded up to a power of two, torch threads) take turns
between the two products, timed where they run, and once each has run three times the process
keeps the faster (its fastest call) for that size, as `cache/int8_dots.py` does for the key
copy: which one wins depends on the CPU's BLAS. The two differ by rounding only (another
summation order).

The copies cost the linear weights' bytes once more (`packed_bytes`): SmolLM2-135M in fp32
538 MB. That is why `auto` does not choose this layout.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["available", "chosen_products", "is_packed", "pack", "packed_bytes", "unpack"]

PRODUCTS = ("onednn", "blas")  # onednn: the reordered copy; blas: F.linear over the dense weight
TIMED_CALLS = 3  # per product and size, the fastest kept
PACK_ROWS = 8  # the row count the copy is reordered for (measured: 4 to 32 give the same speed)
_ATTR = "_flashmem_onednn"  # the reordered weight, on the module

_chosen: dict[tuple[int, int, int, int], str] = {}  # (in, out, rows rounded up to a power of two, threads)
_trials: dict[tuple[int, int, int, int], dict[str, list[float]]] = {}  # sizes being timed: seconds per product


class _Copy:
    """A module's reordered weight. oneDNN's tensors have no storage that deepcopy or pickle can
    read, so a copied module's holder starts empty and is reordered again at its first use."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        self.weight = weight

    def __deepcopy__(self, memo: dict[int, Any]) -> _Copy:
        return _Copy()

    def __reduce__(self) -> tuple[type[_Copy], tuple[()]]:
        return _Copy, ()

    def of(self, m: torch.nn.Linear) -> torch.Tensor:
        if self.weight is None:
            self.weight = _reorder(m)
        return self.weight


def _reorder(m: torch.nn.Linear) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_ROWS)


def available() -> bool:
    """Whether this torch has oneDNN's prepacked linear (x86 and ARM CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(model: Any) -> int:
    """Give every plain fp32/bf16 ``nn.Linear`` of ``model`` (on a CPU) its reordered copy and the
    forward that picks a product per size -> how many were given one."""
    added = 0
    for m in _linears(model):
        if hasattr(m, _ATTR):
            continue
        setattr(m, _ATTR, _Copy(_reorder(m)))
        # a partial, not a bound method: pickle (torch.save of a module) finds _forward by name
        m.forward = functools.partial(_forward, m)  # type: ignore[method-assign]
        added += 1
    return added


def unpack(model: Any) -> int:
    """Drop the copies (the modules compute as ``nn.Linear`` again) -> how many were dropped."""
    dropped = 0
    for m in model.modules():
        if hasattr(m, _ATTR):
            delattr(m, _ATTR)
            m.__dict__.pop("forward", None)
            dropped += 1
    return dropped


def is_packed(model: Any) -> bool:
    """Whether every plain linear of ``model`` has its copy (and there is one)."""
    ms = list(_linears(model))
    return bool(ms) and all(hasattr(m, _ATTR) for m in ms)


def packed_bytes(model: Any) -> int:
    """Bytes the reordered copies take (each about its weight's: oneDNN's blocked layout pads little)."""
    return sum(m.weight.nbytes for m in model.modules() if hasattr(m, _ATTR))  # modules() yields each once


def chosen_products() -> dict[tuple[int, int, int, int], str]:
    """The products this process chose so far, by (in, out, rows rounded up to a power of two, threads)."""
    return dict(_chosen)


def _linears(model: Any) -> Iterator[torch.nn.Linear]:
    """The plain linears (``weight_layout._plain``) with fp32 or bf16 weights on a CPU."""
    from flashmem.models.weight_layout import _plain

    for m in model.modules():
        if _plain(m) and m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32, torch.bfloat16):
            yield m


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward, through the reordered copy where that measured faster for this size."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows < 2 or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != self.weight.dtype:
        return F.linear(x, self.weight, self.bias)
    size = (self.in_features, self.out_features, 1 << (rows - 1).bit_length(), torch.get_num_threads())
    chosen = _chosen.get(size)
    if chosen is None:
        return _trial(self, size, x)
    return _PRODUCT[chosen](self, x)


def _trial(m: torch.nn.Linear, size: tuple[int, int, int, int], x: torch.Tensor) -> torch.Tensor:
    """One of the first calls of `size`: they take turns between the products, each timed
    where it runs (in a model's forward a weight is read from memory, not from a cache warmed
    by a loop over the same call, which favoured MKL's product for SmolLM2's 576 x 576 weights
    where oneDNN's is faster in the forward); once each has TIMED_CALLS, the faster (its
    fastest call) is kept for `size`."""
    times = _trials.setdefault(size, {name: [] for name in PRODUCTS})
    name = min(PRODUCTS, key=lambda p: len(times[p]))  # in turns, oneDNN's first
    out, seconds = _run_timed(name, m, x)
    times[name].append(seconds)
    if all(len(t) >= TIMED_CALLS for t in times.values()):
        _chosen[size] = min(PRODUCTS, key=lambda p: min(times[p]))
        del _trials[size]
    return out


def _run_timed(name: str, m: torch.nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Product `name` of x -> (its result, the seconds it took: a CPU runs it synchronously)."""
    t0 = time.perf_counter()
    out = _PRODUCT[name](m, x)
    return out, time.perf_counter() - t0


def _blas(m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m.weight, m.bias)


def _onednn(m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), getattr(m, _ATTR).of(m), m.bias, "none", [], "")


_PRODUCT: dict[str, Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]] = {"blas": _blas, "onednn": _onednn}
