"""The re-rank's codes: every sealed block's keys in `lsa_rerank_codec`'s bits, on the host.

With `lsa_rerank_codec` other than exact, the re-rank (cache/ranking.py) scores its
candidate pages by these codes instead of their exact keys: a read of bits/16 of a
bf16 key per candidate (docs/accelerator.md). They sit beside the cold tier in host
memory, are coded as blocks seal (the keys are at hand then), and are read where
they lie: scored by host compute when the layer ranks on the host, else the
candidates' codes are copied to the device and decoded there. Host memory, not
the device budget, pays for them: bits/16 of the keys' bytes (1/16-1/4 of a bf16
key plus an fp16 scale and zero per channel and block).

Shapes: the arena holds blocks [n, b, h, B, d * bits / 8] (codes) and
[n, b, h, 1, d] (zero, scale); candidates [b, h, c] page ids decode to
[b, h, c, P, d].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashmem.compress import key_code
from flashmem.config import RERANK_CODE_BITS

HOST = torch.device("cpu")


class RerankCodes:
    """One layer's codes of its sealed blocks' keys, in host memory, grown by doubling."""

    def __init__(self, codec: str, block_tokens: int, page_tokens: int) -> None:
        self.codec = codec
        self.bits = RERANK_CODE_BITS[codec]
        self.B, self.P = block_tokens, page_tokens
        self.n = 0  # blocks coded
        self.q: torch.Tensor | None = None  # [cap, b, h, B, d*bits/8] uint8
        self.zero: torch.Tensor | None = None  # [cap, b, h, 1, d] fp16
        self.scale: torch.Tensor | None = None

    # ------------------------------------------------------------------ writes
    def extend(self, k: torch.Tensor) -> None:
        """Keys k [b, h, nb*B, d] of the next nb sealed blocks (any device) are coded."""
        b, h, T, d = k.shape
        nb = T // self.B
        if nb == 0:
            return
        blocks = k[:, :, : nb * self.B].reshape(b, h, nb, self.B, d).permute(2, 0, 1, 3, 4)
        code = key_code.encode(blocks, self.codec).to(HOST)  # coded where the keys are, then moved
        self._grow(self.n + nb, code)
        assert self.q is not None and self.zero is not None and self.scale is not None
        self.q[self.n : self.n + nb] = code.q
        self.zero[self.n : self.n + nb] = code.zero
        self.scale[self.n : self.n + nb] = code.scale
        self.n += nb

    def fill(self, num_sealed: int, read_keys: Callable[[int], torch.Tensor]) -> None:
        """Code the blocks up to num_sealed not coded yet (a state restored into the cold tier
        without passing a seal), their keys [b, h, B, d] read by `read_keys(block)`."""
        while self.n < num_sealed:
            self.extend(read_keys(self.n))

    def select_rows(self, src: torch.Tensor) -> None:
        """Rows change (beam search, batch selection): new row r is old row src[r]."""
        if self.q is None:
            return
        src = src.to(HOST)
        self.q = self.q[: self.n].index_select(1, src)
        self.zero = self.zero[: self.n].index_select(1, src) if self.zero is not None else None
        self.scale = self.scale[: self.n].index_select(1, src) if self.scale is not None else None

    def _grow(self, need: int, like: key_code.KeyCode) -> None:
        if self.q is not None and self.q.shape[0] >= need:
            return
        cap = max(need, 2 * (self.q.shape[0] if self.q is not None else 0), 16)

        def bigger(old: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
            t = part.new_empty((cap, *part.shape[1:]))
            if old is not None:
                t[: self.n] = old[: self.n]
            return t

        self.q = bigger(self.q, like.q)
        self.zero = bigger(self.zero, like.zero)
        self.scale = bigger(self.scale, like.scale)

    # ------------------------------------------------------------------ reads
    def pages(self, cand: torch.Tensor) -> tuple[key_code.KeyCode, int]:
        """The codes of pages cand [b, h, c] (ids of P-token pages, B / P per block) gathered on
        the host -> (code q [b, h, c, P, d*bits/8], zero/scale [b, h, c, 1, d]; bytes read)."""
        assert self.q is not None and self.zero is not None and self.scale is not None
        b, h, c = cand.shape
        ppb = self.B // self.P
        cand = cand.to(HOST)
        blk, pg = cand // ppb, cand % ppb
        bi = torch.arange(b)[:, None, None]
        hi = torch.arange(h)[None, :, None]
        n, _, _, _, w = self.q.shape
        q = self.q.view(n, b, h, ppb, self.P, w)[blk, bi, hi, pg]  # [b, h, c, P, w]
        zero = self.zero[blk, bi, hi]  # [b, h, c, 1, d]
        scale = self.scale[blk, bi, hi]
        code = key_code.KeyCode(q, zero, scale, self.bits)
        # a page's codes, and its block's zero and scale (read once per page: the upper bound)
        return code, code.nbytes

    def nbytes(self) -> int:
        """Host bytes the coded blocks take."""
        if self.q is None or self.zero is None or self.scale is None:
            return 0
        per = (self.q[0].nbytes + self.zero[0].nbytes + self.scale[0].nbytes) if self.q.shape[0] else 0
        return self.n * per
