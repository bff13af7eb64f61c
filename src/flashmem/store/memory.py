"""Host-memory cold tier: blocks kept as CPU tensors (pinned when CUDA is present)."""

from __future__ import annotations

import threading

import torch

from flashmem.store.base import BlockKey, ColdStore, StoreStats


class MemoryStore(ColdStore):
    def __init__(self) -> None:
        self._blocks: dict[BlockKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.stats = StoreStats()

    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        pin = torch.cuda.is_available() and k.is_cuda
        kc = k.detach().to("cpu", copy=True)
        vc = v.detach().to("cpu", copy=True)
        if pin:  # pinned host memory lets the gather copy back asynchronously
            kc, vc = kc.pin_memory(), vc.pin_memory()
        with self._lock:
            self._blocks[key] = (kc, vc)
            self.stats.puts += 1
            self.stats.bytes_written += _nbytes(kc) + _nbytes(vc)

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            k, v = self._blocks[key]
            self.stats.gets += 1
            self.stats.bytes_read += _nbytes(k) + _nbytes(v)
        if device is not None and torch.device(device) != k.device:
            return k.to(device, non_blocking=True), v.to(device, non_blocking=True)
        return k, v

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def nbytes(self) -> int:
        with self._lock:
            return sum(_nbytes(k) + _nbytes(v) for k, v in self._blocks.values())

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
