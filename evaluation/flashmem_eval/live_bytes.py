"""The bytes of tensors alive at once, counted on any device: what `torch.cuda.max_memory_allocated`
reads on a GPU, measured on a CPU.

`memory_report()` adds up what the cache's tiers hold and the transients its code declares; a
temporary nobody declared (a prompt chunk's index scores [b, h, nq, pages], 4.3 GB at 128K on
Llama-3.1-8B's geometry) shows only in the allocator's peak, and a CPU has no such peak. This
counts every tensor storage an ATen operator creates inside the `with` block (views and
in-place results share a storage and are not counted again; a view of a storage made before the
block is not counted) until its last tensor is freed, and keeps the peak
and, at the peak, which flashmem function made the live bytes (the innermost frame under
src/flashmem/, "model" for the rest). Storages made before the block are not counted, nor,
with `exclude`, those made by flashmem functions whose module.function starts with one of its
prefixes (`("store.",)`: the cold tier, which lives in host memory on a GPU).

    with LiveBytes() as live:
        flashmem.prefill(model, cache, ids)
    live.peak, live.peak - live.live   # the peak; the transient part (freed by the end)
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_SRC = os.sep + os.path.join("src", "flashmem") + os.sep


def caller(skip: int = 2) -> str:
    """The innermost flashmem function on the stack as module.function ("model" when none)."""
    f = sys._getframe(skip)
    while f is not None:
        path = f.f_code.co_filename
        if _SRC in path:
            return path.split(_SRC, 1)[1].removesuffix(".py").replace(os.sep, ".") + "." + f.f_code.co_name
        f = f.f_back  # type: ignore[assignment]
    return "model"


class LiveBytes(TorchDispatchMode):
    """Live tensor-storage bytes created under the mode: `live` now, `peak`, and `at_peak`
    ({caller: bytes} of what was live at the peak, with `by_caller`)."""

    def __init__(self, by_caller: bool = False, exclude: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.by_caller = by_caller or bool(exclude)
        self.exclude = exclude
        self.live = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._refs: Counter[int] = Counter()  # storage -> tensors alive on it
        self._bytes: dict[int, int] = {}
        self._owner: dict[int, str] = {}

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key, 0)
            self._owner.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage (a view, an in-place or out= op) allocated nothing:
        # counted only if its storage was made under the mode
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        who = None
        for t in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or (key in given and key not in self._bytes):
                continue
            if key not in self._bytes:
                if self.by_caller:
                    who = who or caller()
                    if who.startswith(self.exclude):
                        continue
                    self._owner[key] = who
                self._bytes[key] = storage.nbytes()
                self.live += storage.nbytes()
            self._refs[key] += 1
            weakref.finalize(t, self._release, key)
        if self.live > self.peak:
            self.peak = self.live
            if self.by_caller:
                agg: Counter[str] = Counter()
                for key, nbytes in self._bytes.items():
                    agg[self._owner.get(key, "?")] += nbytes
                self.at_peak = dict(agg.most_common())
        return out

    def summary(self, top: int = 8) -> dict[str, Any]:
        """{'peak': bytes, 'live': bytes, 'at_peak': the top callers' bytes}."""
        return {"peak": self.peak, "live": self.live, "at_peak": dict(list(self.at_peak.items())[:top])}
