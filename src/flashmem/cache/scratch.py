"""One reused buffer per slot for a step's largest transients: attention's keys, values and mask.

A decode step's keys and values (sinks, the decoded working set, the window) are
tens of MB per layer at 32K+ tokens. Allocated fresh for every layer and step, the
CPU allocator hands out newly mapped memory each time and the step pays the page
faults (at 32K on the tiny model, about 30% of the step: docs/measurements.md,
"Decode cost of the int8 working set, cut"); a prefill chunk's attention mask is
100+ MB. Attention calls in one thread run one after another, so every layer of
every cache a thread runs shares one buffer per slot (`thread_scratch`); it grows
to the largest step's size and stays, as a GPU's caching allocator keeps freed
blocks. `memory_report()` reports it as `scratch_bytes`, apart from the KV tiers.
"""

from __future__ import annotations

import math
import threading

import torch

_local = threading.local()

# A prompt chunk's bounded transients (its attention mask, `assembly.MASK_BYTES`; its index
# scores, `index.selection.SCORE_BLOCK_BYTES`, whose CPU bound is the same) are sized for an
# accelerator's memory (64 MiB: Llama-3.1-8B at 128K). On a CPU they are the process's RAM,
# beside a budget of tens of MB: there they are held to this. The tiny model at 64K (1/8: a
# 67 MB budget) held 99 MB of index-mass copies and 60 MB of mask at its prompt's peak
# (docs/results.md, stop 64).
CPU_TRANSIENT_BYTES = 8 << 20


def transient_cap(nbytes: int, device: torch.device) -> int:
    """The bound `nbytes` of a step's transient as it applies on `device`: at most
    CPU_TRANSIENT_BYTES on a CPU, as is elsewhere."""
    return min(nbytes, CPU_TRANSIENT_BYTES) if device.type == "cpu" else nbytes


def thread_scratch() -> Scratch:
    """The calling thread's buffers (made on first use)."""
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = Scratch()
    return scratch


class Scratch:
    """Buffers by (slot, dtype, device); `take` returns a view valid until the next
    `take` of the same slot (the caller uses it within one attention call)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def take(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        # a buffer made under torch.inference_mode() cannot be written outside it (and the
        # other way round would leak an inference tensor into autograd): one set per mode
        key = (slot, dtype, torch.device(device), torch.is_inference_mode_enabled())
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            # a quarter to spare: the working set grows a page at a time as the context does
            buf = self._bufs[key] = torch.empty(n + n // 4, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()
