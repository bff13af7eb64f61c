"""A store's per-block bookkeeping in numpy columns, not Python objects per block.

A disk tier keeps, for every block it holds, where its record lies (segment, offset, length,
xxh64), its layout and its unit sums (store/page_sums.py), and the write-behind core its payload
bytes. As dicts of dataclasses, ints and one small array a block they took 923 traced bytes a
block, 192 of them the sums: SmolLM2's 3,840 blocks at 8K, 3.5 MB, 0.075x its 1/8 budget (45 MiB),
a share that does not shrink with the context (0.3x of a 1/32 budget). Here a block costs its
sums and about 60 bytes of columns and row maps (338 traced bytes a block with the columns' and
the arena's room to grow: `benchmarks/diagnostics/store_bookkeeping.py`; docs/results.md, stop
68). `(layer, block)` keys map to rows through one int32 array per layer, indexed by block (the
cache numbers a layer's blocks 0, 1, 2, ...), and keys far from that through a dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from flashmem.store.base import BlockKey

# a layer's row map indexed by block grows to at most this past its largest block so far (then
# doubling): a key far beyond (a sparse or negative block number) goes to the dict instead
DENSE_SLACK = 1024


class KeyRows:
    """(layer, block) -> row (int >= 0), -1 where absent. Rows are the caller's to number."""

    def __init__(self) -> None:
        self._dense: dict[int, np.ndarray] = {}  # layer -> int32 [n] rows by block, -1: absent
        self._other: dict[BlockKey, int] = {}
        self._n = 0

    def get(self, key: BlockKey) -> int:
        layer, block = key
        rows = self._dense.get(layer)
        if rows is not None and 0 <= block < rows.shape[0]:
            r = int(rows[block])
            if r >= 0:
                return r
        return self._other.get((int(layer), int(block)), -1)

    def set(self, key: BlockKey, row: int) -> None:
        layer, block = int(key[0]), int(key[1])
        rows = self._dense.get(layer)
        size = 0 if rows is None else rows.shape[0]
        if 0 <= block < size + DENSE_SLACK and (layer, block) not in self._other:
            if block >= size:
                grown = np.full(max(2 * size, block + 1, 64), -1, dtype=np.int32)
                if rows is not None:
                    grown[:size] = rows
                self._dense[layer] = rows = grown
            assert rows is not None
            self._n += int(rows[block]) < 0
            rows[block] = row
            return
        self._n += (layer, block) not in self._other
        self._other[(layer, block)] = row

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[BlockKey]:
        return (key for key, _ in self.items())

    def items(self) -> Iterator[tuple[BlockKey, int]]:
        for layer, rows in self._dense.items():
            held = np.flatnonzero(rows >= 0)
            for block, r in zip(held.tolist(), rows[held].tolist()):
                yield (layer, block), r
        yield from self._other.items()

    def clear(self) -> None:
        self._dense.clear()
        self._other.clear()
        self._n = 0


class Column:
    """A growable 1-D numpy column (appends double its capacity)."""

    def __init__(self, dtype: type | np.dtype) -> None:
        self.data = np.empty(0, dtype=dtype)
        self.n = 0

    def append(self, value: int) -> int:
        """Append a value -> its index."""
        at = self.n
        if at == self.data.shape[0]:
            grown = np.empty(max(2 * at, 64), dtype=self.data.dtype)
            grown[:at] = self.data[:at]
            self.data = grown
        self.data[at] = value
        self.n = at + 1
        return at

    def clear(self) -> None:
        self.data = np.empty(0, dtype=self.data.dtype)
        self.n = 0


class Arena:
    """Append-only runs of uint64 values in chunks that are never copied: a chunk without room
    for a run is left and a new one begins, each twice the last up to CHUNK_MAX values (a longer
    run gets a chunk of its own). Growth by copying one array would hold the old and the new at
    once: twice the sums, at the moment a block is put."""

    CHUNK_MIN = 256
    CHUNK_MAX = 1 << 16

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.used = 0  # values used in the last chunk
        self.n = 0  # values appended in all

    def append(self, values: np.ndarray) -> tuple[int, int]:
        """Append a run -> (chunk, offset) where it lies."""
        v = np.asarray(values, dtype=np.uint64).reshape(-1)
        if not self.chunks or self.used + v.size > self.chunks[-1].shape[0]:
            size = self.CHUNK_MIN if not self.chunks else min(2 * self.chunks[-1].shape[0], self.CHUNK_MAX)
            self.chunks.append(np.empty(max(size, v.size), dtype=np.uint64))
            self.used = 0
        at = self.used
        self.chunks[-1][at : at + v.size] = v
        self.used += v.size
        self.n += v.size
        return len(self.chunks) - 1, at

    def run(self, chunk: int, at: int, n: int) -> np.ndarray:
        """The run of n values at (chunk, at): a view."""
        return self.chunks[chunk][at : at + n]

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def clear(self) -> None:
        self.chunks.clear()
        self.used = self.n = 0


class BlockSizes:
    """Every block a store holds -> its payload bytes: the dict operations the write-behind
    core uses, kept in a KeyRows and an int64 column (a re-put key keeps its row)."""

    def __init__(self, sizes: Mapping[BlockKey, int] | None = None) -> None:
        self._rows = KeyRows()
        self._size = Column(np.int64)
        for key, n in (sizes or {}).items():
            self[key] = n

    def get(self, key: BlockKey, default: int = 0) -> int:
        r = self._rows.get(key)
        return default if r < 0 else int(self._size.data[r])

    def __setitem__(self, key: BlockKey, n: int) -> None:
        r = self._rows.get(key)
        if r >= 0:
            self._size.data[r] = n
        else:
            self._rows.set(key, self._size.append(n))

    def __contains__(self, key: object) -> bool:
        if not (isinstance(key, tuple) and len(key) == 2):
            return False
        try:
            return self._rows.get((int(key[0]), int(key[1]))) >= 0
        except (TypeError, ValueError):
            return False

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def total(self) -> int:
        """The payload bytes of every block held."""
        return sum(int(self._size.data[r]) for _, r in self._rows.items())

    def clear(self) -> None:
        self._rows.clear()
        self._size.clear()


class BlockTable:
    """A disk tier's committed blocks: per block its commit entry's fields (segment, offset of
    its record, payload length and xxh64), its layout (shape and dtype, one id into a short
    list) and its unit sums (uint64, in an Arena; a re-put block's new ones are appended, so a
    reader holding the old ones keeps valid bytes)."""

    def __init__(self) -> None:
        self.rows = KeyRows()
        self.segment = Column(np.int32)
        self.offset = Column(np.int64)
        self.payload_len = Column(np.int64)
        self.payload_sum = Column(np.uint64)
        self.layout_id = Column(np.int16)
        self.sums_chunk = Column(np.int32)  # the arena's chunk; -1: no sums (read whole)
        self.sums_at = Column(np.int32)  # where in it
        self.sums_n = Column(np.int32)
        self.arena = Arena()
        self.layouts: list[tuple[object, object]] = []  # (shape, dtype) by id

    def _columns(self) -> tuple[Column, ...]:
        return (
            self.segment,
            self.offset,
            self.payload_len,
            self.payload_sum,
            self.layout_id,
            self.sums_chunk,
            self.sums_at,
            self.sums_n,
        )

    def put(
        self,
        key: BlockKey,
        segment: int,
        offset: int,
        payload_len: int,
        payload_sum: int,
        layout: tuple[object, object],
        sums: np.ndarray | None,
    ) -> None:
        try:
            lid = self.layouts.index(layout)
        except ValueError:
            lid = len(self.layouts)
            self.layouts.append(layout)
        chunk, at = (-1, 0) if sums is None else self.arena.append(sums)
        n = 0 if sums is None else sums.size
        fields = (segment, offset, payload_len, payload_sum, lid, chunk, at, n)
        r = self.rows.get(key)
        if r < 0:  # a new row: every column appended at the same index
            self.rows.set(key, self.segment.n)
            for col, v in zip(self._columns(), fields):
                col.append(v)
        else:
            for col, v in zip(self._columns(), fields):
                col.data[r] = v

    def row(self, key: BlockKey) -> int:
        """The key's row, -1 where it is not held."""
        return self.rows.get(key)

    def layout(self, r: int) -> tuple[object, object]:
        return self.layouts[int(self.layout_id.data[r])]

    def sums(self, r: int) -> np.ndarray | None:
        """Row r's unit sums (a view of the arena), None where it has none."""
        chunk = int(self.sums_chunk.data[r])
        return None if chunk < 0 else self.arena.run(chunk, int(self.sums_at.data[r]), int(self.sums_n.data[r]))

    def __contains__(self, key: BlockKey) -> bool:
        return self.rows.get(key) >= 0

    def __len__(self) -> int:
        return len(self.rows)

    def nbytes(self) -> int:
        """Bytes of the columns and the arena as allocated (the row maps aside)."""
        return sum(c.data.nbytes for c in self._columns()) + self.arena.nbytes()

    def clear(self) -> None:
        self.rows.clear()
        for col in self._columns():
            col.clear()
        self.arena.clear()
        self.layouts.clear()
