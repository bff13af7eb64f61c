"""The cold tier's pinned host memory seen from the device: gathers with no host wait.

Pinned host memory has one address for the host and the device (CUDA's unified addressing),
so a kernel given page ids that stay on the device can read the pages straight across the
link: on an H200, 1,024 pages of 4 KB in 109 us, against 262 us for ids to the host, the pages
cut there and one copy, and 108 us replayed from a CUDA graph
(benchmarks/diagnostics/uva_gather.py, results/uva_gather_h200.json). PyTorch has no public
call that wraps host memory as a CUDA tensor; CuPy's `UnownedMemory` and DLPack do, when CuPy
is installed (it is optional: without it the caller's gather reads through the host).
"""

from __future__ import annotations

import torch


def mapped_view(host: torch.Tensor, device_id: int = 0) -> torch.Tensor:
    """A CUDA tensor over the same bytes as `host` (pinned, contiguous): the device reads them
    across the link. Needs CuPy; `host` must outlive the view (the view holds a reference)."""
    import cupy as cp

    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("a mapped view needs pinned, contiguous host memory")
    nbytes = host.numel() * host.element_size()
    # unified addressing: the host address is the device's (CuPy 14's runtime module has no
    # hostGetDevicePointer)
    mem = cp.cuda.UnownedMemory(host.data_ptr(), nbytes, owner=host, device_id=device_id)
    arr = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
    return torch.from_dlpack(arr).view(host.dtype).view(host.shape)


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` as `device` can gather from it: itself where it already lies there (a CPU, or a
    tier on the device), a mapped view on CUDA where one can be made, else itself (a gather
    then sends its ids to the host: one wait)."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host
    try:
        return mapped_view(host, device.index if device.index is not None else torch.cuda.current_device())
    except (ImportError, ValueError, RuntimeError):
        return host
