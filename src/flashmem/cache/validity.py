"""Which positions a layer has seen hold real tokens (not padding): [b, tokens seen] bool.

Kept in a buffer with doubling capacity, so appending a decode step's token copies
nothing (a cat per step would copy the whole history); a crop shortens the view, and
a beam reorder picks rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Validity:
    def __init__(self, rows: int, device: torch.device) -> None:
        self._buf = torch.zeros(rows, 1024, dtype=torch.bool, device=device)
        self.length = 0

    @property
    def view(self) -> torch.Tensor:
        """[b, length]: True where a position holds a real token."""
        return self._buf[:, : self.length]

    def set(self, value: torch.Tensor) -> None:
        """A restored state's validity [b, n]."""
        self._buf = value.clone()
        self.length = value.shape[-1]

    def append(self, valid: torch.Tensor) -> None:
        """New positions' validity [b, m]."""
        n, m = self.length, valid.shape[-1]
        if n + m > self._buf.shape[-1]:
            grown = torch.zeros(
                valid.shape[0], max(2 * self._buf.shape[-1], n + m), dtype=torch.bool, device=valid.device
            )
            grown[:, :n] = self._buf[:, :n]
            self._buf = grown
        self._buf[:, n : n + m] = valid
        self.length = n + m

    def drop_last(self, n: int) -> None:
        """Forget the newest n positions (a crop); the capacity stays, the next append overwrites."""
        self.length -= n

    def pick_rows(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Rows reordered or selected by `pick` (a beam reorder): [b, cap] -> [b', cap]."""
        self._buf = pick(self._buf)
