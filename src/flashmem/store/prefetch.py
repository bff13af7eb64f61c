"""Prefetcher: background loads of cold blocks predicted for the next steps.

    pf = Prefetcher(store, threads=2)
    pf.request([(layer, block), ...])   # non-blocking, de-duplicated
    pf.request(keys, urgent=True)       # a step waits on these: read before any look-ahead
    k, v = pf.get((layer, block), device)  # hit if already loaded; else miss + stall time

Loaded blocks wait host-side in a bounded ready buffer (coded payloads when the
store can hand them out, so int4 blocks are decoded on the target device; for a
layered store the load also fills its RAM tier), least recently used first out.
A block stays there after `get` hands it out (`keep_used`), so a block that
leaves a selection and comes back a few steps later (selections flicker at the
cut) is a hit, and look-ahead asking again for a block just used reads nothing.
threads=0: `request` does nothing and every `get` is a synchronous load
(counted as a miss), nothing kept. Thread-safe.

Two queues feed the loader threads: urgent loads (the blocks a decode step is
about to wait on) are taken before any look-ahead load, so a step's misses do
not queue behind predictions for later steps. An urgent request for a block
already queued as look-ahead moves it to the urgent queue. (`urgent_first =
False` and `keep_used = False` give the previous behaviour, one FIFO and a
block taken out by `get`, for A/B runs: docs/measurements.md, "A step's misses
first, used blocks kept".)

Blocks are keyed (layer, block) by the cache, but the same key names another
block once a layer starts a new sequence: `new_sequence(layer)` moves the layer
to a fresh generation, and every ready or in-flight load is keyed by the
generation it was requested in, so a load of the previous sequence can never be
handed out again (it is dropped when it lands).

On CUDA the copy to the device overlaps compute too (docs/accelerator.md,
"Prefetch"). A loaded block is held in pinned host memory (`ensure_host`), and as
soon as it lands (or when look-ahead asks again for a ready block) its
host-to-device copy is issued on a dedicated copy stream with an event recorded
after it (`CopyStream`). The device is the one the layer's blocks were last asked
for on (`get`), or `request(..., device=)`. `get` then hands out that device copy
after making the compute stream wait on the event: no host wait, no
`torch.cuda.synchronize`. Device copies waiting to be used are bounded by
`stage_bytes`: one leaves when `get` hands it out or its block leaves the ready
buffer, and the oldest unused ones make room for new ones (a prediction that did
not come true). A block that is not staged (a late or synchronous load, or one
kept after use) is copied when `get` asks for it, on the compute stream. On other
devices nothing is staged: the same calls, no streams.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from flashmem.store.base import BlockKey, ColdStore
from flashmem.store.transfer import CopyStream, decode_on, ensure_host, same_device

# a loaded block: ("coded", payload uint8 [n], shape, dtype, shared) or ("kv", k, v)
Entry = tuple
# (layer, block, generation of the layer's sequence when the load was asked for)
Scoped = tuple[int, int, int]
# a block's copy issued ahead to a device: (copier, tensors on the device, event after the copy, bytes)
Staged = tuple[CopyStream, tuple[torch.Tensor, ...], "torch.cuda.Event | None", int]


class Prefetcher:
    def __init__(
        self, store: ColdStore, threads: int, *, ready_bytes: int = 256 * 2**20, stage_bytes: int = 64 * 2**20
    ) -> None:
        """threads: loader threads (0: synchronous loads); ready_bytes: the host-side ready
        buffer's cap; stage_bytes: cap on device copies issued ahead and not yet used (CUDA)."""
        self.store = store
        self.threads = int(threads)
        self.ready_bytes = int(ready_bytes)
        self.stage_bytes = int(stage_bytes)
        self._coded = store.coded_reads
        self.urgent_first = True
        self.keep_used = self.threads > 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # queued loads; a future taken by a loader (running) or already done is skipped
        self._queues: dict[bool, deque[tuple[Scoped, Future]]] = {True: deque(), False: deque()}
        self._ready: OrderedDict[Scoped, Entry] = OrderedDict()
        self._ready_size = 0
        self._inflight: dict[Scoped, Future] = {}
        self._generation: dict[int, int] = {}  # layer -> its current sequence's generation
        self._staged: OrderedDict[Scoped, Staged] = OrderedDict()  # ready blocks already on their device
        self._staged_size = 0
        self._devices: dict[int, torch.device] = {}  # layer -> the device its blocks are asked for on
        self._copiers: dict[torch.device, CopyStream] = {}
        self._closed = False
        self._c = {
            "hits": 0,
            "misses": 0,
            "late": 0,
            "requested": 0,
            "loaded": 0,
            "evicted": 0,
            "errors": 0,
            "staged": 0,  # device copies issued ahead (CUDA)
            "staged_hits": 0,  # hits handed out as such a copy
            "stage_dropped": 0,  # staged copies dropped unused to make room
            "stage_errors": 0,  # copies that could not be issued (the block stays host-side)
        }
        self._stall_s = 0.0
        self._load_s = 0.0
        self._workers = [
            threading.Thread(target=self._worker, name=f"flashmem-prefetch-{i}", daemon=True)
            for i in range(max(0, self.threads))
        ]
        for t in self._workers:
            t.start()

    # ------------------------------------------------------------------ API
    def request(self, keys: Iterable[BlockKey], urgent: bool = False, device: torch.device | str | None = None) -> int:
        """Queue background loads of `keys` not yet ready or in flight; returns how many were
        queued. urgent: a step is about to wait on them (read before look-ahead loads; one
        queued as look-ahead is moved up). device: where they will be asked for (default:
        where their layer's blocks were last asked for): on CUDA their copies there are
        issued as soon as they are loaded."""
        if not self._workers:
            return 0
        n = 0
        urgent = urgent and self.urgent_first
        with self._lock:
            if self._closed:
                return 0
            for key in keys:
                key = (int(key[0]), int(key[1]))
                if device is not None:
                    self._devices[key[0]] = same_device(device)
                sk = self._scoped(key)
                if sk in self._ready or key not in self.store:
                    continue
                fut = self._inflight.get(sk)
                if fut is not None:
                    if urgent and not fut.running() and not fut.done():
                        self._queues[True].append((sk, fut))  # its look-ahead entry is skipped later
                    continue
                self._inflight[sk] = fut = Future()
                self._queues[urgent].append((sk, fut))
                n += 1
            self._c["requested"] += n
            self._wake.notify(n)
        return n

    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's (k, v) on `device`; a hit when it was already prefetched."""
        key = (int(key[0]), int(key[1]))
        dev = same_device(device) if device is not None else None
        t0 = time.perf_counter()
        staged: Staged | None = None
        with self._lock:
            if dev is not None:
                self._devices[key[0]] = dev  # later loads of this layer are staged there
            sk = self._scoped(key)
            entry = self._ready.get(sk)
            fut = None
            if entry is not None:
                staged = self._staged.pop(sk, None)  # the device copy goes to the caller
                if staged is not None:
                    self._staged_size -= staged[3]
                    if staged[0].device != dev:
                        staged = None  # asked for elsewhere: copied again below
                    else:
                        self._c["staged_hits"] += 1
                if self.keep_used:
                    self._ready.move_to_end(sk)
                else:
                    self._drop_ready(sk)
                self._c["hits"] += 1
            else:
                fut = self._inflight.pop(sk, None)  # claimed: the loader will not park it
                if fut is not None and self.urgent_first and not fut.running() and not fut.done():
                    self._queues[True].append((sk, fut))  # still queued behind look-ahead: move it up
                    self._wake.notify()
        if entry is None:
            try:
                entry = fut.result() if fut is not None else self._load(key)
            finally:
                with self._lock:
                    self._c["misses"] += 1
                    self._c["late"] += fut is not None
                    self._stall_s += time.perf_counter() - t0
            if self.keep_used:
                with self._lock:
                    if sk[2] == self._generation.get(key[0], 0) and not self._closed:
                        self._park(sk, entry)
        if staged is not None:
            copier, moved, done, _ = staged
            return self._from_device(entry, copier.wait(moved, done), copier.device)
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
            for sk in [sk for sk in self._staged if sk[0] == layer]:
                self._unstage(sk)

    def stats(self) -> dict[str, float]:
        """hits, misses (late: in flight when asked), stall_s, requested, loaded, evicted,
        ready blocks/bytes, and `<tier>_bytes_read/_bytes_written/...` per store tier."""
        with self._lock:
            out: dict[str, float] = dict(self._c)
            out["stall_s"] = self._stall_s
            out["load_s"] = self._load_s
            out["ready_blocks"] = len(self._ready)
            out["ready_bytes"] = self._ready_size
            out["staged_blocks"] = len(self._staged)
            out["staged_bytes"] = self._staged_size
            out["inflight"] = len(self._inflight)
        for tier, st in self.store.tier_stats().items():
            for name, val in st.items():
                out[f"{tier}_{name}"] = val
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for q in self._queues.values():
                while q:
                    q.popleft()[1].cancel()  # a get waiting on it raises CancelledError
            self._wake.notify_all()
        for t in self._workers:
            t.join()
        with self._lock:
            self._ready.clear()
            self._ready_size = 0
            self._staged.clear()
            self._staged_size = 0
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
        self._unstage(sk)

    def _unstage(self, sk: Scoped) -> None:
        """Forget a block's device copy (only the copy stream used it: its memory is free)."""
        st = self._staged.pop(sk, None)
        if st is not None:
            self._staged_size -= st[3]

    def _copier(self, device: torch.device) -> CopyStream:
        c = self._copiers.get(device)
        if c is None:
            c = self._copiers[device] = CopyStream(device)
        return c

    def _stage(self, sk: Scoped, entry: Entry) -> None:
        """Issue the copy of a ready block to its layer's device now, ahead of `get` (CUDA;
        elsewhere nothing), dropping the oldest unused staged copies beyond `stage_bytes`."""
        nbytes = _size(entry)
        with self._lock:
            dev = self._devices.get(sk[0])
            if dev is None or self._closed or sk in self._staged or nbytes > self.stage_bytes:
                return
            copier = self._copier(dev)
            if not copier.stages:
                return
            while self._staged and self._staged_size + nbytes > self.stage_bytes:
                self._unstage(next(iter(self._staged)))
                self._c["stage_dropped"] += 1
            self._staged_size += nbytes  # reserved while the copy is issued
        moved: tuple[torch.Tensor, ...] = ()
        done = None
        try:
            moved, done = copier.issue((entry[1],) if entry[0] == "coded" else (entry[1], entry[2]))
        except RuntimeError:  # e.g. out of device memory: `get` copies the block when asked
            with self._lock:
                self._c["stage_errors"] += 1
        finally:
            with self._lock:
                self._staged_size -= nbytes
                # kept only while its block is still ready (not used, evicted or of an ended sequence)
                if moved and self._ready.get(sk) is entry and sk not in self._staged and not self._closed:
                    self._staged[sk] = (copier, moved, done, nbytes)
                    self._staged_size += nbytes
                    self._c["staged"] += 1

    def _load(self, key: BlockKey) -> Entry:
        t0 = time.perf_counter()
        if self._coded:
            payload, shape, dtype, shared = self.store.get_coded(key)
            entry: Entry = ("coded", ensure_host(payload), shape, dtype, shared)
        else:
            k, v = self.store.get(key, "cpu")
            entry = ("kv", ensure_host(k), ensure_host(v))  # pinned when CUDA is present
        with self._lock:
            self._load_s += time.perf_counter() - t0
            self._c["loaded"] += 1
        return entry

    def _worker(self) -> None:
        """A loader thread: urgent loads first, then look-ahead loads, each in request order."""
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    q = self._queues[True] or self._queues[False]
                    if not q:
                        self._wake.wait()
                        continue
                    sk, fut = q.popleft()
                    if not fut.running() and not fut.done() and fut.set_running_or_notify_cancel():
                        break
            try:
                fut.set_result(self._background(sk))
            except BaseException as exc:  # kept in the future; an unclaimed one is retried by get
                fut.set_exception(exc)

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
            parked = self._inflight.get(sk) is not None and not self._closed
            if parked:
                del self._inflight[sk]
                self._park(sk, entry)
        if parked:
            self._stage(sk, entry)  # its copy to the device starts now, ahead of `get`
        return entry

    def _park(self, sk: Scoped, entry: Entry) -> None:
        """Put a loaded block in the ready buffer (newest), evicting the least recently used."""
        self._drop_ready(sk)
        self._ready[sk] = entry
        self._ready_size += _size(entry)
        while self._ready_size > self.ready_bytes and len(self._ready) > 1:
            _, old = self._ready.popitem(last=False)
            self._ready_size -= _size(old)
            self._c["evicted"] += 1

    def _materialize(self, entry: Entry, device) -> tuple[torch.Tensor, torch.Tensor]:
        if entry[0] == "coded":
            _, payload, shape, dtype, shared = entry
            return decode_on(self.store.codec, payload, shape, dtype, device, shared)
        _, k, v = entry
        if device is None:
            return k, v
        return k.to(device, non_blocking=k.is_pinned()), v.to(device, non_blocking=v.is_pinned())

    def _from_device(
        self, entry: Entry, moved: tuple[torch.Tensor, ...], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block from its staged device copy (the compute stream already waits on it)."""
        if entry[0] == "coded":
            _, _, shape, dtype, _ = entry
            return decode_on(self.store.codec, moved[0], shape, dtype, device, False)  # the copy is ours
        return moved[0], moved[1]


def _size(entry: Entry) -> int:
    if entry[0] == "coded":
        return int(entry[1].numel())
    return int(entry[1].numel() * entry[1].element_size() * 2)
