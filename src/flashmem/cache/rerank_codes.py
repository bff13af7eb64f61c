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

from flashmem.cache import int8_dots
from flashmem.compress import key_code, page_code
from flashmem.config import RERANK_CODE_BITS
from flashmem.store.transfer import pinning

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
            # pinned where a GPU is present: the static step's gather reads it from the device
            t = torch.empty((cap, *part.shape[1:]), dtype=part.dtype, pin_memory=pinning())
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
    """The candidate pages' codes held on the device (`lsa_rerank_on_device`), the re-rank's
    own page cache: a candidate the last step held keeps its codes; only the others' are
    gathered from the host arena, cross the link, and are written in place into the slots of
    pages that stopped being candidates (no second copy of the held codes).

    Held per (row, head) in S >= c slots: idx [b, h, S] the page each slot holds (-1: none),
    q [b, h, S, P, w], zero / scale [b, h, S, 1, d]. `update` returns, for each candidate,
    its slot [b, h, c]."""

    def __init__(self) -> None:
        self.idx: torch.Tensor | None = None
        self.code: key_code.KeyCode | None = None

    def update(
        self, cand: torch.Tensor, arena: RerankCodes, device: torch.device
    ) -> tuple[key_code.KeyCode, torch.Tensor, int, int]:
        """Hold the codes of cand [b, h, c] (sorted) on `device` -> (the held codes, each
        candidate's slot [b, h, c], bytes copied, candidates copied)."""
        cand = cand.contiguous().to(device)  # every page a candidate: an expanded view
        b, h, c = cand.shape
        idx, code = self.idx, self.code
        if idx is None or code is None or idx.shape[:2] != (b, h) or not idx.shape[-1]:
            fresh, nbytes = arena.pages(cand)
            self.idx, self.code = cand.clone(), fresh.to(device)
            slots = torch.arange(c, device=device).expand(b, h, c)
            return self.code, slots, nbytes, cand.numel()
        if idx.shape[-1] < c:  # more candidates than slots (more pages sealed): empty slots
            idx, code = self._grow(c)
        S = idx.shape[-1]
        order = idx.argsort(-1)
        by_page = idx.gather(-1, order)
        pos = torch.searchsorted(by_page, cand).clamp_max_(S - 1)
        held = by_page.gather(-1, pos) == cand  # [b, h, c]
        slots = order.gather(-1, pos)  # a held candidate's slot
        new = ~held
        copied = int(new.sum())
        if not copied:
            return code, slots, 0, 0
        # free slots: those whose page is no candidate now; new candidates take them in order
        at = torch.searchsorted(cand, idx).clamp_max_(c - 1)
        free = cand.gather(-1, at) != idx  # [b, h, S]; per row, #free >= #new since S >= c
        free_first = (~free).to(torch.uint8).argsort(dim=-1, stable=True)
        rank = (new.cumsum(-1) - 1).clamp_min_(0)
        slots = torch.where(new, free_first.gather(-1, rank), slots)
        fresh, nbytes = arena.pages_flat(cand, new)  # [n_new, P, w] in (b, h, c) order
        row = (torch.arange(b * h, device=device) * S).view(b, h, 1)
        dest = (row + slots)[new]  # flat slot of each new candidate
        idx.view(-1)[dest] = cand[new]
        for held_t, fresh_t in ((code.q, fresh.q), (code.zero, fresh.zero), (code.scale, fresh.scale)):
            held_t.view(-1, *held_t.shape[-2:]).index_copy_(0, dest, fresh_t.to(device))
        return code, slots, nbytes, copied

    def reserve(
        self, b: int, h: int, S: int, arena: RerankCodes, device: torch.device
    ) -> tuple[torch.Tensor, key_code.KeyCode]:
        """At least S slots for rows (b, h) on `device`, the codes held kept and new slots empty
        (-1), shaped as `arena`'s codes -> (idx [b, h, S' >= S], the held codes): the static
        step's (cache/static_step.py), which writes into them in place."""
        idx = self.idx
        if idx is None or self.code is None or idx.shape[:2] != (b, h) or idx.device != device:
            assert arena.q is not None and arena.zero is not None and arena.scale is not None
            w, d = arena.q.shape[-1], arena.zero.shape[-1]
            self.idx = torch.full((b, h, S), -1, dtype=torch.long, device=device)
            self.code = key_code.KeyCode(
                torch.zeros(b, h, S, arena.P, w, dtype=arena.q.dtype, device=device),
                torch.zeros(b, h, S, 1, d, dtype=arena.zero.dtype, device=device),
                torch.zeros(b, h, S, 1, d, dtype=arena.scale.dtype, device=device),
                arena.bits,
            )
        elif idx.shape[-1] < S:
            self._grow(S)
        assert self.idx is not None and self.code is not None
        return self.idx, self.code

    def _grow(self, S: int) -> tuple[torch.Tensor, key_code.KeyCode]:
        """More slots (S), the new ones empty; the held codes move once."""
        assert self.idx is not None and self.code is not None
        old, more = self.code, S - self.idx.shape[-1]

        def wider(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros((*t.shape[:2], more, *t.shape[3:]))], dim=2)

        self.idx = torch.cat([self.idx, self.idx.new_full((*self.idx.shape[:2], more), -1)], dim=-1)
        self.code = key_code.KeyCode(wider(old.q), wider(old.zero), wider(old.scale), old.bits)
        return self.idx, self.code

    def nbytes(self) -> int:
        return 0 if self.code is None else self.code.nbytes

    def clear(self) -> None:
        self.idx = self.code = None


class KeyMirror:
    """One layer's sealed keys copied into host memory for the in-place re-rank
    (`lsa_rerank_mirror`): every sealed token's key [b, h, T, d] in one run per (row, KV
    head), grown by doubling, so one GEMM per layer scores every sealed token (the cold
    tier's arena holds blocks [n, b, h, B, d]: n small GEMMs over keys in the model's dtype).

    - bf16: the keys in bf16, scored in bf16 (AMX / avx512_bf16 on recent x86): half the
      bytes of fp32 keys; the logits are rounded to bf16 (about 3 significant digits)
      before the softmax;
    - int8: each token's key scaled by its largest channel (an fp32 scale per token and
      KV head), scored against int8 queries with exact integer sums (`torch._int_mm`, or an
      fp32 GEMM where the CPU lacks int8 dot instructions: cache/int8_dots.py): a quarter
      of the bytes of fp32 keys.

    Filled as blocks seal (`extend`, the seal's keys at hand) or, for blocks that never
    passed a seal here (a restored state), read back (`fill`); rows follow the cache's
    row changes (`select_rows`); a crop never reaches sealed blocks, and `fill` cuts
    blocks past num_sealed."""

    def __init__(self, dtype: str, block_tokens: int) -> None:
        if dtype not in ("bf16", "int8"):
            raise ValueError(f"KeyMirror: dtype {dtype!r} is not allowed; allowed: bf16 or int8")
        self.dtype = dtype
        self.B = block_tokens
        self.n = 0  # blocks held
        self.k: torch.Tensor | None = None  # [b, h, cap, d] bf16 or int8
        self.scale: torch.Tensor | None = None  # int8: [b, h, cap] fp32

    @property
    def tokens(self) -> int:
        return self.n * self.B

    # ------------------------------------------------------------------ writes
    def extend(self, k: torch.Tensor) -> None:
        """Keys k [b, h, nb*B, d] of the next nb sealed blocks (any device) are copied."""
        b, h, T, d = k.shape
        T = T // self.B * self.B
        if T == 0:
            return
        x = k[:, :, :T].detach().to(HOST)
        if self.dtype == "bf16":
            code, scale = x.to(torch.bfloat16), None
        else:
            code, scale = _int8_rows(x.float())
        self._grow(self.tokens + T, code)
        assert self.k is not None
        t0 = self.tokens
        self.k[:, :, t0 : t0 + T] = code
        if scale is not None:
            assert self.scale is not None
            self.scale[:, :, t0 : t0 + T] = scale
        self.n += T // self.B

    def fill(self, num_sealed: int, read_keys: Callable[[int], torch.Tensor]) -> None:
        """Hold blocks 0..num_sealed-1: those past it are cut, the missing ones' keys
        [b, h, B, d] read by `read_keys(block)`."""
        if num_sealed < self.n:
            self.n = num_sealed
        while self.n < num_sealed:
            self.extend(read_keys(self.n))

    def select_rows(self, src: torch.Tensor) -> None:
        """Rows change (beam search, batch selection): new row r is old row src[r]."""
        if self.k is None:
            return
        src = src.to(HOST)
        self.k = self.k[:, :, : self.tokens].index_select(0, src)
        if self.scale is not None:
            self.scale = self.scale[:, :, : self.tokens].index_select(0, src)

    def _grow(self, need: int, like: torch.Tensor) -> None:
        if self.k is not None and self.k.shape[2] >= need and self.k.shape[:2] == like.shape[:2]:
            return
        old = self.k if self.k is not None and self.k.shape[:2] == like.shape[:2] else None
        if old is None:
            self.n = 0
        cap = max(need, 2 * (old.shape[2] if old is not None else 0), 4 * self.B)
        b, h, _, d = like.shape
        t = self.tokens
        k = like.new_empty((b, h, cap, d))
        if old is not None:
            k[:, :, :t] = old[:, :, :t]
        self.k = k
        if self.dtype == "int8":
            scale = torch.empty(b, h, cap)
            if old is not None and self.scale is not None:
                scale[:, :, :t] = self.scale[:, :, :t]
            self.scale = scale

    # ------------------------------------------------------------------ reads
    def logits(self, qg: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
        """Logits of queries qg [b, h, nq, d] against every held token, times `scaling` ->
        fp32 [b, h, nq, T] (T = n * B, in token order). int8: contiguous (query-major); bf16:
        the transpose of a contiguous [b, h, T, nq]. index/rerank.py token_page_mass works on
        either layout in place."""
        assert self.k is not None
        T = self.tokens
        keys = self.k[:, :, :T]
        q = qg.to(HOST)
        if self.dtype == "bf16":
            # [b, h, T, d] @ [b, h, d, nq]: the keys streamed once, a few columns each
            out = torch.matmul(keys, q.to(torch.bfloat16).transpose(-1, -2)).float()  # [b, h, T, nq]
            return (out.mul_(scaling) if scaling != 1.0 else out).transpose(-1, -2)
        assert self.scale is not None
        b, h, nq, d = q.shape
        qi, qs = _int8_rows(q.float())  # [b, h, nq, d], [b, h, nq]
        # per row and KV head, the int8 keys [T, d] against the queries [nq, d] -> exact int32
        # sums [nq, T], in the GEMM form timed fastest on this CPU (cache/int8_dots.py)
        sums = int8_dots.dots(keys.flatten(0, 1), qi.reshape(b * h, nq, d)).view(b, h, nq, T)
        # Query-major, so each query's logits are one contiguous run of tokens: the int32 ->
        # fp32 conversion writes them so, and the scales and the softmax after all run along it
        # (token-major, a mixed-dtype multiply and a strided softmax measured 1.6x slower per
        # layer at SmolLM2's 8K shape). The queries' scales and `scaling` are nq numbers.
        if sums.dtype == torch.float32 and sums.is_contiguous():
            out = sums  # the float32 form's sums are fp32 query-major already
        else:
            out = torch.empty(b, h, nq, T)
            out.copy_(sums)
        return out.mul_(self.scale[:, :, None, :T]).mul_((qs * scaling)[..., None])

    def page_codes(
        self, idx: torch.Tensor, page_tokens: int, only: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """int8: the codes and scales of the keys of pages idx [b, h, k] (page_tokens tokens
        each, in held blocks) -> [b, h, k, P, d] and [b, h, k, P, 1]; with `only` [b, h, k] bool
        just those pages, flat: [n, P, d] and [n, P, 1]. They are the working set's int8 code of
        the same keys (`page_code.encode`, per token), so its new pages' keys are cut from here,
        not read in the model's dtype and coded again. None: a bf16 copy, or other rows."""
        if self.dtype != "int8" or self.k is None or tuple(self.k.shape[:2]) != tuple(idx.shape[:2]):
            return None
        assert self.scale is not None
        b, h, cap, d = self.k.shape  # cap: whole blocks, so whole pages
        P = page_tokens
        rows = (torch.arange(b * h).view(b, h, 1) * (cap // P) + idx.to(HOST)).reshape(-1)  # row r, head j: r*h + j
        if only is not None:
            rows = rows[only.reshape(-1).to(HOST)]
        codes = self.k.view(-1, P * d).index_select(0, rows)
        scale = self.scale.view(-1, P).index_select(0, rows)
        shape = (-1,) if only is not None else tuple(idx.shape)
        return codes.view(*shape, P, d), scale.view(*shape, P, 1)

    def nbytes(self) -> int:
        """Host bytes the held tokens take (the capacity past them not counted)."""
        if self.k is None:
            return 0
        b, h, _, d = self.k.shape
        per = d * self.k.element_size() + (4 if self.scale is not None else 0)
        return b * h * self.tokens * per


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] fp32 -> int8 [..., d] and the fp32 scale [...] of each row: the working
    set's per-token code (compress/page_code.py; a zero row has scale 0)."""
    codes, scale = page_code.encode(x)
    return codes, scale.squeeze(-1)
