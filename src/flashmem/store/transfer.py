"""Host buffers and host->device copies, the same code on CPU and CUDA.

With CUDA present, host buffers are pinned so `.to(device, non_blocking=True)`
is a real asynchronous copy; on CPU-only machines they are plain tensors.

`CopyStream` issues copies ahead of need on a dedicated CUDA stream and records
an event after them; the consumer makes its (compute) stream wait on that event
(`wait_event`, never `torch.cuda.synchronize`) and marks the tensors as used there
(`record_stream`). On any other device it does nothing (`stages` is False) and the
caller copies when it needs the data, as before.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from flashmem.store.codecs.base import Codec, Shape


@functools.lru_cache(maxsize=1)
def pinning() -> bool:
    return torch.cuda.is_available()


def host_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on the host, pinned when a GPU could read it."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinning())


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor made by numpy (one memcpy on the calling
    thread: torch's copy_ goes through the intra-op thread pool, which costs
    milliseconds per block when the cores are busy)."""
    t = t.detach()
    if t.dim() == 0 or t.stride(-1) != 1:
        return t.contiguous().clone()
    raw = np.array(t.view(torch.uint8).numpy(), copy=True, order="C")
    return torch.from_numpy(raw).view(t.dtype)


def cpu_cat_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate the bytes of CPU tensors: uint8 [sum of nbytes] (numpy, one copy)."""
    arrays = []
    for t in parts:
        t = t.detach()
        if t.dim() and t.stride(-1) != 1:
            t = t.contiguous()
        arrays.append(t.view(torch.uint8).numpy().reshape(-1) if t.dim() else t.reshape(1).view(torch.uint8).numpy())
    return torch.from_numpy(np.concatenate(arrays))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (pinned when CUDA is present); never aliases `t`."""
    if t.device.type == "cpu" and not pinning():
        return cpu_copy(t)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinning())
    out.copy_(t.detach())
    return out


def ensure_host(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it is already a usable host tensor (fresh, e.g. a codec's output), else a host copy."""
    if t.device.type == "cpu" and (t.is_pinned() or not pinning()):
        return t
    return to_host(t)


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    if device is None:
        return t
    device = torch.device(device)
    if t.device == device:
        return t
    return t.to(device, non_blocking=t.is_pinned() if t.device.type == "cpu" else False)


def same_device(device: torch.device | str) -> torch.device:
    """`device` with its index filled in for CUDA ("cuda" -> "cuda:<current>"), so two names
    of one device compare equal; other devices as given."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class CopyStream:
    """Host-to-device copies issued ahead of need, overlapping compute (CUDA only).

    issue(tensors) -> (moved, event): on CUDA the copies run on this object's own
    stream (pinned sources make them asynchronous to the host too), followed by a
    recorded event. wait(moved, event) -> moved: the current (compute) stream waits
    for that event on the device (the host does not block) and each tensor is
    recorded as used on it, so the allocator does not reuse its memory while
    compute still reads it. On other devices `stages` is False: the prefetcher
    then keeps blocks host-side and `issue` is a plain copy, `wait` a no-op.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = same_device(device)
        self.stages = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.stages else None

    def issue(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
        if self.stream is None:
            return tuple(to_device(t, self.device) for t in tensors), None
        with torch.cuda.stream(self.stream):
            moved = tuple(t.to(self.device, non_blocking=t.is_pinned()) for t in tensors)
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, done

    def wait(self, moved: tuple[torch.Tensor, ...], event: torch.cuda.Event | None) -> tuple[torch.Tensor, ...]:
        if event is None:
            return moved
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)  # device-side: the host does not block
        for t in moved:
            t.record_stream(current)  # made on the copy stream, used on this one
        return moved


def decode_on(
    codec: Codec,
    payload: torch.Tensor,
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device | str | None,
    shared: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the coded payload (uint8 [n]) to `device` (pinned -> async) and decode
    there -> (k, v) of `shape`. shared: the payload is kept elsewhere too (a
    cache), so a decode that would alias it must copy."""
    moved = to_device(payload, device)
    copy = shared and moved.data_ptr() == payload.data_ptr()
    return codec.decode(moved, shape, dtype, copy=copy)
