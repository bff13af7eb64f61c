"""Whether a cache may take another step: closed, failed mid-step, or a batch-size change.

A model step updates every layer in turn; an exception in one layer (a cold-tier
write error, a damaged block) leaves the layers before it one step ahead of the
ones after it. Rather than compute on such a half-updated cache, the guard
refuses every later step with one line until `cache.reset()` starts a new
sequence. Shared by the cache and its FlashLayers.
"""

from __future__ import annotations

from flashmem.errors import ColdStoreError, FlashMemError


class StepGuard:
    def __init__(self) -> None:
        self.closed = False
        self.failure: str | None = None  # one line: the error that interrupted a step
        self.batch: int | None = None  # rows of the current sequence

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

    def fail(self, exc: BaseException) -> None:
        """Record the first error that interrupted a step."""
        if self.failure is None:
            self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0]

    def reset(self) -> None:
        self.failure = None
        self.batch = None
