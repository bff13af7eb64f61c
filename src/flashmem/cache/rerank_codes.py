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

    def pages_flat(self, cand: torch.Tensor, only: torch.Tensor) -> tuple[key_code.KeyCode, int]:
        """`pages` for the candidates where only [b, h, c] is True, flat: q [n, P, w],
        zero / scale [n, 1, d] in (b, h, c) order."""
        assert self.q is not None and self.zero is not None and self.scale is not None
        b, h, c = cand.shape
        ppb = self.B // self.P
        m = only.to(HOST)
        ids = cand.to(HOST)[m]
        bi = torch.arange(b)[:, None, None].expand(b, h, c)[m]
        hi = torch.arange(h)[None, :, None].expand(b, h, c)[m]
        blk, pg = ids // ppb, ids % ppb
        n, _, _, _, w = self.q.shape
        q = self.q.view(n, b, h, ppb, self.P, w)[blk, bi, hi, pg]  # [n_new, P, w]
        flat = key_code.KeyCode(q, self.zero[blk, bi, hi], self.scale[blk, bi, hi], self.bits)
        return flat, flat.nbytes

    def nbytes(self) -> int:
        """Host bytes the coded blocks take."""
        if self.q is None or self.zero is None or self.scale is None:
            return 0
        per = (self.q[0].nbytes + self.zero[0].nbytes + self.scale[0].nbytes) if self.q.shape[0] else 0
        return self.n * per


class DeviceCandidates:
    """This step's candidate pages' codes held on the device (`lsa_rerank_on_device`), the
    re-rank's own page cache: a candidate the last step held keeps its codes; only the others'
    are gathered from the host arena and cross the link. Held per (row, head):
    idx [b, h, c] sorted page ids, q [b, h, c, P, w], zero / scale [b, h, c, 1, d]."""

    def __init__(self) -> None:
        self.idx: torch.Tensor | None = None
        self.code: key_code.KeyCode | None = None

    def update(self, cand: torch.Tensor, arena: RerankCodes, device: torch.device) -> tuple[key_code.KeyCode, int, int]:
        """Hold the codes of cand [b, h, c] (sorted) on `device` -> (their code, bytes copied,
        candidates copied)."""
        cand = cand.contiguous()  # every page a candidate: an expanded view
        prev, old = self.idx, self.code
        held = src = None
        if prev is not None and old is not None and prev.shape[:2] == cand.shape[:2] and prev.shape[-1]:
            src = torch.searchsorted(prev, cand).clamp_max_(prev.shape[-1] - 1)  # both sorted
            held = prev.gather(-1, src) == cand
        if held is None or not bool(held.any()):
            code, nbytes = arena.pages(cand)
            code, copied = code.to(device), cand.numel()
        else:
            assert old is not None and src is not None and prev is not None
            new = ~held
            copied = int(new.sum())
            b, h, c = cand.shape
            # the new candidates' codes, gathered on the host in (b, h, c) order, cross together
            fresh, nbytes = arena.pages_flat(cand, new)
            fresh = fresh.to(device)
            bi = torch.arange(b, device=cand.device)[:, None, None]
            hi = torch.arange(h, device=cand.device)[None, :, None]
            rows_prev = b * h * prev.shape[-1]
            old_rows = ((bi * h + hi) * prev.shape[-1] + src).reshape(-1)
            flat = held.reshape(-1)
            pick = torch.where(flat, old_rows, rows_prev + new.reshape(-1).cumsum(0) - 1)

            def merged(o: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
                width = o.shape[-2:]
                both = torch.cat([o.reshape(-1, *width), f.reshape(-1, *width)])
                return both.index_select(0, pick.to(both.device)).view(b, h, c, *width)

            code = key_code.KeyCode(
                merged(old.q, fresh.q), merged(old.zero, fresh.zero), merged(old.scale, fresh.scale), old.bits
            )
        self.idx, self.code = cand, code
        return code, nbytes, copied

    def nbytes(self) -> int:
        return 0 if self.code is None else self.code.nbytes

    def clear(self) -> None:
        self.idx = self.code = None
