"""Layered cold tier: a RAM LRU of coded blocks (cold_ram_bytes) in front of a DiskStore.

Every block goes to disk; the LRU keeps the most recently put or read payloads
(as coded, so int4 fits ~3.5x more blocks than exact). A block larger than the
whole budget is not cached. ram_bytes=0 turns the RAM tier off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from flashmem.errors import ColdStoreError
from flashmem.store.base import BlockKey, ColdStore, StoreStats
from flashmem.store.codecs.base import Shape, check_pair
from flashmem.store.disk import DiskStore
from flashmem.store.transfer import decode_on, ensure_host


class LayeredStore(ColdStore):
    tier = "layered"
    coded_reads = True

    def __init__(self, disk: DiskStore, ram_bytes: int) -> None:
        self.disk = disk
        self.codec = disk.codec
        self.ram_bytes = int(ram_bytes)
        self._lru: OrderedDict[BlockKey, tuple[torch.Tensor, Shape, torch.dtype]] = OrderedDict()
        self._lru_bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.ram = StoreStats()  # RAM tier counters (hits, misses, evictions in extra)
        self.stats = StoreStats()  # the store as a whole, as the cache sees it

    @property
    def path(self) -> str:
        return self.disk.path

    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = check_pair(k, v)
        payload = ensure_host(self.codec.encode(k.detach(), v.detach()))  # uint8 [n] host
        key = (int(key[0]), int(key[1]))
        with self._lock:
            self._check_open("put")
            self.stats.puts += 1
            self.stats.bytes_written += payload.numel()
            self.ram.puts += 1
            self._insert(key, (payload, shape, k.dtype))
        self.disk.put_coded(key, payload, shape, k.dtype)

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        payload, shape, dtype, shared = self.get_coded(key)
        return decode_on(self.codec, payload, shape, dtype, device, shared)

    def get_coded(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        with self._lock:
            self._check_open("get")
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                self._count_get(hit[0].numel(), ram_hit=True)
                return (*hit, True)
        payload, shape, dtype, shared = self.disk.get_coded(key)
        with self._lock:
            self._count_get(payload.numel(), ram_hit=False)
            self._insert(key, (payload, shape, dtype))
        return payload, shape, dtype, True

    def _count_get(self, n: int, ram_hit: bool) -> None:
        self.stats.gets += 1
        self.stats.bytes_read += n
        name = "hits" if ram_hit else "misses"
        self.ram.extra[name] = self.ram.extra.get(name, 0) + 1
        if ram_hit:
            self.ram.gets += 1
            self.ram.bytes_read += n

    def _insert(self, key: BlockKey, entry: tuple[torch.Tensor, Shape, torch.dtype]) -> None:
        n = entry[0].numel()
        old = self._lru.pop(key, None)
        if old is not None:
            self._lru_bytes -= old[0].numel()
        if n > self.ram_bytes:
            return
        self._lru[key] = entry
        self._lru_bytes += n
        self.ram.bytes_written += n
        while self._lru_bytes > self.ram_bytes:
            _, (p, _, _) = self._lru.popitem(last=False)
            self._lru_bytes -= p.numel()
            self.ram.extra["evictions"] = self.ram.extra.get("evictions", 0) + 1

    def ram_nbytes(self) -> int:
        return self._lru_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._lru or key in self.disk

    def keys(self) -> list[BlockKey]:
        return self.disk.keys()

    def nbytes(self) -> int:
        return self.disk.nbytes()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        ram = self.ram.as_dict()
        ram["resident_bytes"] = self._lru_bytes
        return {"ram": ram, "disk": self.disk.stats.as_dict()}

    def flush(self) -> None:
        self.disk.flush()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ColdStoreError(f"cold store {self.disk.path}: {what} after close; allowed: a new store")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lru.clear()
            self._lru_bytes = 0
        self.disk.close()
