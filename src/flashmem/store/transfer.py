"""Host buffers and host->device copies, the same code on CPU and CUDA.

With CUDA present, host buffers are pinned so `.to(device, non_blocking=True)`
is a real asynchronous copy; on CPU-only machines they are plain tensors.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def pinning() -> bool:
    return torch.cuda.is_available()


def host_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on the host, pinned when a GPU could read it."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinning())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (pinned when CUDA is present); never aliases `t`."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinning())
    out.copy_(t.detach())
    return out


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    if device is None:
        return t
    device = torch.device(device)
    if t.device == device:
        return t
    return t.to(device, non_blocking=t.is_pinned() if t.device.type == "cpu" else False)
