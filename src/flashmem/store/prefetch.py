"""Prefetcher: background loads of cold blocks predicted for the next steps.

    pf = Prefetcher(store, threads=2)
    pf.request([(layer, block), ...])   # non-blocking, de-duplicated
    k, v = pf.get((layer, block), device)  # hit if already loaded; else miss + stall time

Loaded blocks wait host-side in a bounded ready buffer (coded payloads when the
store can hand them out, so int4 blocks are decoded on the target device; for a
layered store the load also fills its RAM tier). `get` takes a block out of
the ready buffer. threads=0: `request` does nothing and every `get` is a
synchronous load (counted as a miss). Thread-safe.

Blocks are keyed (layer, block) by the cache, but the same key names another
block once a layer starts a new sequence: `new_sequence(layer)` moves the layer
to a fresh generation, and every ready or in-flight load is keyed by the
generation it was requested in, so a load of the previous sequence can never be
handed out again (it is dropped when it lands).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from flashmem.store.base import BlockKey, ColdStore
from flashmem.store.transfer import decode_on

# a loaded block: ("coded", payload uint8 [n], shape, dtype, shared) or ("kv", k, v)
Entry = tuple
# (layer, block, generation of the layer's sequence when the load was asked for)
Scoped = tuple[int, int, int]


class Prefetcher:
    def __init__(self, store: ColdStore, threads: int, *, ready_bytes: int = 256 * 2**20) -> None:
        self.store = store
        self.threads = int(threads)
        self.ready_bytes = int(ready_bytes)
        self._coded = store.coded_reads
        self._pool = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="flashmem-prefetch") if self.threads > 0 else None
        )
        self._lock = threading.Lock()
        self._ready: OrderedDict[Scoped, Entry] = OrderedDict()
        self._ready_size = 0
        self._inflight: dict[Scoped, Future] = {}
        self._generation: dict[int, int] = {}  # layer -> its current sequence's generation
        self._closed = False
        self._c = {"hits": 0, "misses": 0, "late": 0, "requested": 0, "loaded": 0, "evicted": 0, "errors": 0}
        self._stall_s = 0.0
        self._load_s = 0.0

    # ------------------------------------------------------------------ API
    def request(self, keys: Iterable[BlockKey]) -> int:
        """Queue background loads of `keys` not yet ready or in flight; returns how many were queued."""
        if self._pool is None:
            return 0
        n = 0
        with self._lock:
            if self._closed:
                return 0
            for key in keys:
                key = (int(key[0]), int(key[1]))
                sk = self._scoped(key)
                if sk in self._ready or sk in self._inflight or key not in self.store:
                    continue
                self._inflight[sk] = self._pool.submit(self._background, sk)
                n += 1
            self._c["requested"] += n
        return n

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's (k, v) on `device`; a hit when it was already prefetched."""
        key = (int(key[0]), int(key[1]))
        t0 = time.perf_counter()
        with self._lock:
            sk = self._scoped(key)
            entry = self._ready.pop(sk, None)
            fut = None
            if entry is not None:
                self._ready_size -= _size(entry)
                self._c["hits"] += 1
            else:
                fut = self._inflight.pop(sk, None)  # claimed: the loader will not park it
        if entry is None:
            try:
                entry = fut.result() if fut is not None else self._load(key)
            finally:
                with self._lock:
                    self._c["misses"] += 1
                    self._c["late"] += fut is not None
                    self._stall_s += time.perf_counter() - t0
        return self._materialize(entry, device)

    def discard(self, keys: Iterable[BlockKey] | None = None) -> None:
        """Drop ready blocks (all when keys is None); in-flight loads finish and are kept."""
        with self._lock:
            scoped = list(self._ready) if keys is None else [self._scoped(k) for k in keys]
            for sk in scoped:
                self._drop_ready(sk)

    def new_sequence(self, layer: int) -> None:
        """`layer` starts a new sequence: nothing loaded or asked for before is served to it."""
        with self._lock:
            layer = int(layer)
            self._generation[layer] = self._generation.get(layer, 0) + 1
            for sk in [sk for sk in self._ready if sk[0] == layer]:
                self._drop_ready(sk)
            for sk in [sk for sk in self._inflight if sk[0] == layer]:
                del self._inflight[sk]  # its loader drops the block when it lands

    def stats(self) -> dict[str, float]:
        """hits, misses (late: in flight when asked), stall_s, requested, loaded, evicted,
        ready blocks/bytes, and `<tier>_bytes_read/_bytes_written/...` per store tier."""
        with self._lock:
            out: dict[str, float] = dict(self._c)
            out["stall_s"] = self._stall_s
            out["load_s"] = self._load_s
            out["ready_blocks"] = len(self._ready)
            out["ready_bytes"] = self._ready_size
            out["inflight"] = len(self._inflight)
        for tier, st in self.store.tier_stats().items():
            for name, val in st.items():
                out[f"{tier}_{name}"] = val
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._ready.clear()
            self._ready_size = 0
            self._inflight.clear()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _scoped(self, key: BlockKey) -> Scoped:
        return (key[0], key[1], self._generation.get(key[0], 0))

    def _drop_ready(self, sk: Scoped) -> None:
        e = self._ready.pop(sk, None)
        if e is not None:
            self._ready_size -= _size(e)

    def _load(self, key: BlockKey) -> Entry:
        t0 = time.perf_counter()
        if self._coded:
            entry: Entry = ("coded", *self.store.get_coded(key))
        else:
            entry = ("kv", *self.store.get(key, "cpu"))
        with self._lock:
            self._load_s += time.perf_counter() - t0
            self._c["loaded"] += 1
        return entry

    def _background(self, sk: Scoped) -> Entry:
        try:
            entry = self._load((sk[0], sk[1]))
        except BaseException:
            with self._lock:
                self._inflight.pop(sk, None)
                self._c["errors"] += 1
            raise  # kept in the future; an unclaimed failure is retried by a synchronous get
        with self._lock:
            # parked only while still wanted: not claimed by `get`, not of an ended sequence
            if self._inflight.get(sk) is not None and not self._closed:
                del self._inflight[sk]
                self._ready[sk] = entry
                self._ready_size += _size(entry)
                while self._ready_size > self.ready_bytes and len(self._ready) > 1:
                    _, old = self._ready.popitem(last=False)
                    self._ready_size -= _size(old)
                    self._c["evicted"] += 1
        return entry

    def _materialize(self, entry: Entry, device) -> tuple[torch.Tensor, torch.Tensor]:
        if entry[0] == "coded":
            _, payload, shape, dtype, shared = entry
            return decode_on(self.store.codec, payload, shape, dtype, device, shared)
        _, k, v = entry
        if device is None:
            return k, v
        return k.to(device, non_blocking=k.is_pinned()), v.to(device, non_blocking=v.is_pinned())


def _size(entry: Entry) -> int:
    if entry[0] == "coded":
        return int(entry[1].numel())
    return int(entry[1].numel() * entry[1].element_size() * 2)
