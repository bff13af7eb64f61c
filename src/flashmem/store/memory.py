"""Host-memory cold tier: blocks kept as CPU tensors (pinned when CUDA is present).

With codec "exact" the block's tensors are kept as they are (a `get` to the
same device returns them without a copy: treat them as read-only). With int8 or
int4 the coded payload is kept (uint8 [nbytes]) and decoded on the target
device on `get`.
"""

from __future__ import annotations

import threading

import torch

from flashmem.errors import ColdStoreError
from flashmem.store.base import BlockKey, ColdStore, StoreStats
from flashmem.store.codecs import get_codec
from flashmem.store.codecs.base import check_pair
from flashmem.store.transfer import ensure_host, to_device, to_host


class MemoryStore(ColdStore):
    tier = "memory"

    def __init__(self, codec: str = "exact") -> None:
        self.codec = get_codec(codec)
        # exact: key -> (k, v); coded: key -> (payload uint8 [n], shape, dtype)
        self._blocks: dict[BlockKey, tuple] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.stats = StoreStats()

    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = check_pair(k, v)
        if self.codec.name == "exact":
            entry: tuple = (to_host(k), to_host(v))
            n = 2 * k.numel() * k.element_size()
        else:
            payload = ensure_host(self.codec.encode(k.detach(), v.detach()))
            entry = (payload, shape, k.dtype)
            n = payload.numel()
        with self._lock:
            self._check_open("put")
            old = self._blocks.get(key)
            if old is not None:
                self._bytes -= self._entry_bytes(old)
            self._blocks[key] = entry
            self._bytes += n
            self.stats.puts += 1
            self.stats.bytes_written += n

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            self._check_open("get")
            entry = self._blocks[key]
            self.stats.gets += 1
            self.stats.bytes_read += self._entry_bytes(entry)
        if self.codec.name == "exact":
            k, v = entry
            return to_device(k, device), to_device(v, device)
        payload, shape, dtype = entry
        return self.codec.decode(to_device(payload, device), shape, dtype)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._blocks)

    def nbytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        """Drop every block; any later put or get is a one-line ColdStoreError."""
        with self._lock:
            self._closed = True
            self._blocks.clear()
            self._bytes = 0

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ColdStoreError(f"cold store (memory): {what} after close; allowed: a new store")

    def _entry_bytes(self, entry: tuple) -> int:
        if self.codec.name == "exact":
            k, v = entry
            return 2 * k.numel() * k.element_size()
        return int(entry[0].numel())
