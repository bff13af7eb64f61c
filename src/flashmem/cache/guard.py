"""Whether a cache may take another step: closed, failed mid-step, half-updated,
used from two threads at once, or a batch-size change.

A model step updates every layer in turn (layer 0, 1, ..., n-1). An exception
anywhere in the step (a cold-tier write error, a damaged block, but also the
model's own code: a layer's q_proj that raises before its cache update) leaves
the layers before it one step ahead of the ones after it. Rather than compute on
such a half-updated cache, the guard refuses every later step with one line
until `cache.reset()` starts a new sequence. Two ways to notice it:

- an error inside the cache's own update or attention step (`fail`);
- at the start of every step (an update of a layer at or below the last one
  updated), the layers' lengths are compared: layers left at different lengths
  ([161, 160]) mean the previous step stopped part-way, whatever raised.

A step runs on one thread: while thread A is inside a step (between its first
and last layer's update), an update from thread B is refused with one line and
changes nothing (a cache holds one sequence; two threads would interleave
their tokens). Handing a cache to another thread between steps is allowed.
Shared by the cache and its FlashLayers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from flashmem.errors import ColdStoreError, FlashMemError


class StepGuard:
    def __init__(self, n_layers: int | None = None) -> None:
        self.closed = False
        self.failure: str | None = None  # one line: the error that interrupted a step
        self.batch: int | None = None  # rows of the current sequence
        self.n_layers = n_layers  # the step ends after the update of layer n_layers - 1
        self._mutex = threading.Lock()  # makes the owner check-and-set atomic
        self._owner: threading.Thread | None = None  # the thread inside a step, if any
        self._last_layer = -1  # the last layer updated in the current step

    def check(self, batch: int) -> None:
        """Raise a one-line error unless a step with `batch` rows may run now."""
        if self.closed:
            raise ColdStoreError("cache is closed; allowed: a new cache from flashmem.attach(model, cfg)")
        if self.failure is not None:
            raise FlashMemError(
                f"cache is unusable: an earlier step failed ({self.failure}); "
                "allowed: cache.reset() to start a new sequence, or a new cache"
            )
        if self.batch is not None and batch != self.batch:
            raise FlashMemError(
                f"batch size changed from {self.batch} to {batch} in the middle of a sequence; "
                "allowed: the same batch size for every step, or cache.reset() before a new batch"
            )
        self.batch = batch

    def enter(self, batch: int, layer_idx: int, lengths: Callable[[], list[int]]) -> None:
        """Before layer `layer_idx`'s update: refuse a second thread while a step runs,
        check that the previous step left every layer at the same length, then `check`."""
        me = threading.current_thread()
        with self._mutex:
            owner = self._owner
            if owner is not None and owner is not me and owner.is_alive():
                raise FlashMemError(
                    f"cache is in use by thread {owner.name!r} (a step is running there); "
                    "allowed: one thread at a time per cache (one cache per concurrent sequence)"
                )
            new_step = layer_idx <= self._last_layer or owner is None
            self._owner = me
            self._last_layer = layer_idx
        if self.closed or self.failure is not None:
            self.check(batch)
        if new_step and self.failure is None:
            seen = lengths()
            if len(set(seen)) > 1:
                self.failure = (
                    f"the previous step stopped part-way and left the layers at different lengths {_short(seen)}"
                )
        self.check(batch)

    def leave(self, layer_idx: int) -> None:
        """After layer `layer_idx`'s update (whether it raised or not)."""
        if self.n_layers is not None and layer_idx >= self.n_layers - 1:
            with self._mutex:
                if self._owner is threading.current_thread():
                    self._owner = None
                    self._last_layer = -1

    def fail(self, exc: BaseException) -> None:
        """Record the first error that interrupted a step."""
        if self.failure is None:
            self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0]

    def reset(self) -> None:
        self.failure = None
        self.batch = None
        with self._mutex:
            self._owner = None
            self._last_layer = -1


def _short(lengths: list[int]) -> str:
    """[161, 160] or, for many layers, the distinct lengths with the first layer of each."""
    if len(lengths) <= 8:
        return str(lengths)
    first: dict[int, int] = {}
    for i, n in enumerate(lengths):
        first.setdefault(n, i)
    return "{" + ", ".join(f"{n} tokens from layer {i}" for n, i in sorted(first.items(), key=lambda x: x[1])) + "}"
