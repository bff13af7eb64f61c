"""The cold-tier interface: exact (or coded) K/V of every sealed block.

The cache and the prefetcher talk to a store only through this class, so a new
backend (host memory, disk, layered RAM-over-disk) is one file plus its line in
`flashmem.policies.COLD_STORES`. Keys are (layer_idx, block_idx); a block's
tensors are `[batch, kv_heads, block_tokens, head_dim]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmem.store.codecs.base import Codec, Shape

BlockKey = tuple[int, int]  # (layer_idx, block_idx)


@dataclass
class StoreStats:
    """Counters a store keeps; `cache.stats()` merges them per tier."""

    puts: int = 0
    gets: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """Flat counters: puts, gets, bytes_written, bytes_read and the extras."""
        out: dict[str, float] = {
            "puts": self.puts,
            "gets": self.gets,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
        }
        out.update(self.extra)
        return out


class ColdStore(ABC):
    """Holds sealed blocks off the device; `get` returns them on a chosen device.

    `codec` codes the blocks it holds. A store with `coded_reads` also hands out
    the coded payload (`get_coded`), which the prefetcher buffers and decodes on
    the target device (`flashmem.store.transfer.decode_on`); otherwise the
    prefetcher buffers `get(key, "cpu")`.
    """

    stats: StoreStats
    codec: Codec
    tier: str  # its name in tier_stats()
    coded_reads: bool = False

    @property
    def page_reads(self) -> bool:
        """`gather_pages` hands over just the pages asked for (the default: it declines, and
        pages are cut from whole blocks). Then a reader that takes its pages so on the host
        has no use for whole blocks loaded ahead."""
        return False

    @abstractmethod
    def put(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a copy of a sealed block. k, v: [batch, kv_heads, B, head_dim].

        May return before the bytes are durable (a background write); the block is
        readable by `get` as soon as `put` returns.
        """

    @abstractmethod
    def get(self, key: BlockKey, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's (k, v), decoded to the dtype it was put with, on `device`."""

    def get_coded(self, key: BlockKey) -> tuple[torch.Tensor, Shape, torch.dtype, bool]:
        """The block's coded payload uint8 [n], its shape and dtype, and whether the
        payload is shared with the store (a decode must not alias it). Only where
        `coded_reads` is True."""
        raise NotImplementedError(f"{type(self).__name__} has no coded reads (coded_reads is False)")

    def gather_pages(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """(layer_idx, blocks, within, pages_per_block, device, keys=True, values=True,
        only=None): pages of many blocks in one op: blocks, within [b, h, k] -> k, v
        [b, h, k, P, d] (None for a part not asked for), or None where the store cannot
        (the default: the caller reads whole blocks with `get`). MemoryStore's arena can.
        `only` [b, h, k] bool: just those pages, flat [n, P, d]."""
        return None

    def block_keys(self, layer_idx: int, n: int, device: torch.device | str) -> torch.Tensor | None:
        """The keys of a layer's blocks 0..n-1 as one read-only tensor [n, b, h, B, d] on
        `device`, without a copy, or None where the store cannot (the default)."""
        return None

    def block_run(self, layer_idx: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Blocks start..stop-1 of a layer as one contiguous run, k, v [n, b, h, B, d] in host
        memory without a copy, or None where the store cannot (the default: the caller reads
        the blocks one by one). MemoryStore's arena can; a streamed exact prompt uses it."""
        return None

    @abstractmethod
    def __contains__(self, key: BlockKey) -> bool: ...

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this store holds for its blocks (payload as coded, not Python overhead)."""

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Counters per tier ("memory", "ram", "disk"); a layered store reports each tier."""
        return {self.tier: self.stats.as_dict()}

    def flush(self) -> None:
        """Block until every `put` so far is durable."""

    def close(self) -> None:
        """Release resources; remove files unless the store was asked to persist."""

    def __enter__(self) -> ColdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
