"""ThrottledStore: any cold store behind a slow link, for tests and benchmarks.

Every read is charged `nbytes / bytes_per_s` seconds of sleep after the wrapped
store hands the block over (K and V, or the coded payload), so a read of N bytes
at R bytes/s takes at least N / R: deterministic, whatever the machine. With
`serial` (the default) the charges queue on one lock, like one link or one disk:
two loader threads reading at once take twice as long, not the same time.

Only whole-block reads (`get`, `get_coded`) are offered: the arena paths
(`gather_pages`, `block_keys`, `block_run`) are declined, so the cache reads whole
blocks and every byte it moves is charged. Writes, membership and counters are
the wrapped store's (`tier_stats` is its own; the throttle's own counters are
`charged_bytes`, `charged_s` and `reads`).

    store = ThrottledStore(MemoryStore(), bytes_per_s=1e6)   # 1 MB/s
    with Prefetcher(store, threads=2) as pf: ...
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from flashmem.errors import ConfigError
from flashmem.store.base import BlockKey, ColdStore
from flashmem.store.codecs.base import Shape


class ThrottledStore(ColdStore):
    """`inner` read at `bytes_per_s` (> 0): each read sleeps its bytes / bytes_per_s."""

    def __init__(self, inner: ColdStore, bytes_per_s: float, *, serial: bool = True) -> None:
        if not isinstance(inner, ColdStore):
            raise ConfigError(f"inner: a {type(inner).__name__} is not allowed; allowed: a ColdStore")
        try:
            rate = float(bytes_per_s)
        except (TypeError, ValueError):
            rate = float("nan")
        if not 0 < rate < float("inf"):
            raise ConfigError(f"bytes_per_s: {bytes_per_s!r}; allowed: a finite number > 0")
        self.inner = inner
        self.bytes_per_s = rate
        self.serial = bool(serial)
        self.codec = inner.codec
        self.tier = inner.tier
        self.coded_reads = inner.coded_reads
        self.stats = inner.stats
        self.charged_bytes = 0
        self.charged_s = 0.0
        self.reads = 0
        self._link = threading.Lock()  # held through a charge when serial
        self._count = threading.Lock()

    def seconds(self, nbytes: int) -> float:
        """What a read of `nbytes` is charged."""
        return nbytes / self.bytes_per_s

    def _charge(self, nbytes: int) -> None:
        delay = self.seconds(nbytes)
        with self._link if self.serial else contextlib.nullcontext():
            time.sleep(delay)
        with self._count:
            self.charged_bytes += nbytes
            self.charged_s += delay
            self.reads += 1

    # ------------------------------------------------------------------ reads (charged)
    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.inner.get(key, device)
        self._charge(k.nbytes + v.nbytes)
        return k, v

    def get_coded(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        payload, shape, dtype, shared = self.inner.get_coded(key)
        self._charge(payload.nbytes)
        return payload, shape, dtype, shared

    # ------------------------------------------------------------------ arena paths: declined
    def gather_pages(self, *args: Any, **kwargs: Any) -> None:
        return None

    def block_keys(self, layer_idx: int, n: int, device: torch.device | str) -> None:
        return None

    def block_run(self, layer_idx: int, start: int, stop: int) -> None:
        return None

    # ------------------------------------------------------------------ the rest: the wrapped store's
    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.put(key, k, v)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.inner

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        return self.inner.tier_stats()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
