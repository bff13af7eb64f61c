"""The exact prompt (`prefill_exact_tokens`): a prompt attends every earlier token, as the full cache does.

While the context, with the forward, is within `prefill_exact_tokens`, a prompt
forward (more than one token, before the first one-token forward) attends every
earlier token exactly instead of its selection. From the first one-token forward,
or once the context passes the cap, every chunk attends its selection.

Two ways to do it, the same attention within float tolerance:

- **streamed** (`attend_streamed`, used whenever the cold tier gives exact blocks back:
  `cold_codec: exact`, no `cold_low_rank`): the earlier prompt's K/V is read from the
  tiers (sinks, every sealed block from the cold tier in runs of about one
  `prefill_chunk`, the open block, the window) and the partial attentions are merged
  with an online softmax (running max and sum, as FlashAttention does). Nothing of the
  prompt is held on the device beyond the budget's tiers and one run in flight, so the
  budget holds through the prompt too; the price is the cold tier read once per chunk
  and layer (counted as `h2d_bytes` in `traffic_report()`; on a GPU a prompt is
  compute-bound, docs/accelerator.md).
- **buffered** (`ExactPrompt.attend`, for a lossy cold tier): the layer keeps the
  prompt's K/V on the device in a growing buffer until the prompt ends (the
  `prefill_kv` tier of `memory_report()`, up to the full cache's bytes).

Shapes: queries [b, Hq, m, d]; K/V parts [b, h, n, d]; validity [b, n].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flashmem.cache import sdpa
from flashmem.cache.assembly import bias_from_valid, step_scratch
from flashmem.cache.sdpa import FLASH_CPU

if TYPE_CHECKING:
    from flashmem.cache.flash_layer import FlashLayer


class ExactPrompt:
    """Whether a forward attends the whole prompt, and (buffered) the prompt's K/V."""

    def __init__(self, cap_tokens: int, streamed: bool) -> None:
        self.cap = cap_tokens
        self.streamed = streamed
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0  # tokens in the buffer
        self.want = 0  # tokens the current prompt forward brings the buffer to
        self.open = cap_tokens > 0
        self.peak_transient_bytes = 0  # streamed: the largest run and its scores, one layer

    def admits(self, q: int, seen: int) -> bool:
        """Whether a forward of q new tokens after `seen` tokens attends every earlier token.
        Otherwise the prompt's K/V is dropped for good."""
        if not self.open:
            return False
        if q > 1 and seen + q <= self.cap and (self.streamed or self.length == seen):
            self.want = seen + q
            return True
        self.open = False
        self.k = self.v = None
        return False

    def resume(self, seen: int, every_token: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After a restored state (serve's prefix reuse), buffered: rebuild the prompt's K/V
        from the tiers (`every_token()`: every token's K/V in order, [b, h, seen, d] each), so
        an exact prompt goes on as a fresh prefill would. Streamed, it reads the tiers anyway."""
        if self.streamed or not self.open or seen > self.cap or seen == self.length:
            return
        k, v = every_token()
        assert k.shape[-2] == seen, "the tiers hold every token seen"
        self.k, self.v, self.length = k.contiguous(), v.contiguous(), seen

    def nbytes(self) -> int:
        """Bytes the buffer holds (its capacity)."""
        return sum(t.nbytes for t in (self.k, self.v) if t is not None)

    def read_bytes(self) -> int:
        """Bytes of the K/V an attention over the whole (buffered) prompt so far reads."""
        if self.k is None:
            return 0
        return 2 * self.k[:, :, : self.length].nbytes

    def attend(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, valid: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Buffered: a prompt chunk q [b, Hq, m, d] over every earlier token and itself, causal,
        as the full cache attends -> [b, Hq, m, d]. The chunk joins the prompt's K/V first.
        valid: [b, T + m] validity of every earlier position and the chunk's."""
        b, hkv, m, d = k_new.shape
        T = self.length
        need = T + m
        if self.k is None or self.k.shape[-2] < need:
            # room for the whole forward (a prompt in one forward is allocated once); a prompt
            # fed in several forwards grows by doubling (O(n) copies), never past the cap
            old = 0 if self.k is None else self.k.shape[-2]
            size = max(need, self.want, min(2 * old, self.cap))
            grown = [torch.empty(b, hkv, size, d, dtype=k_new.dtype, device=k_new.device) for _ in range(2)]
            if self.k is not None and self.v is not None:
                grown[0][:, :, :T] = self.k[:, :, :T]
                grown[1][:, :, :T] = self.v[:, :, :T]
            self.k, self.v = grown
        assert self.k is not None and self.v is not None
        self.k[:, :, T:need] = k_new
        self.v[:, :, T:need] = v_new
        self.length = need
        allowed = torch.ones(m, need, dtype=torch.bool, device=q.device).tril(T)[None] & valid[:, None, :]
        allowed[:, :, T:] |= torch.eye(m, dtype=torch.bool, device=q.device)  # each sees itself
        mask = step_scratch().take("mask", (b, 1, m, need), q.dtype, q.device)  # [b, 1, m, T + m]
        mask.zero_().masked_fill_(~allowed[:, None], -math.inf)
        K, V = self.k[:, :, :need], self.v[:, :, :need]
        return sdpa.attention(q, K, V, mask, scaling, q.shape[1] > hkv)


class OnlineSoftmax:
    """Attention of queries q [b, Hq, m, d] over key/value parts added one at a time, merged
    exactly: a running max M, sum L and weighted values O per query (fp32), as FlashAttention
    merges its tiles. `add` takes a part k, v [b, h, n, d] and which keys each query may see.

    On a CPU in fp32, a part that every query sees alike (the earlier prompt: sinks, sealed
    runs, open block, window) is attended by PyTorch's fused flash kernel, which gives the
    part's output and log-sum-exp without writing its scores out, and merged by those
    (`_add_fused`). So are the chunk's own keys, causal, where none is padding (`add_causal`).
    SmolLM2's whole prefill then takes 0.64-0.72x the time of the scores' way at 4K-8K
    (benchmarks/diagnostics/prefill_fused_ab.py). Everything else, and every part off a CPU or
    in another dtype, takes the scores' way."""

    def __init__(self, q: torch.Tensor, hkv: int, scaling: float) -> None:
        b, hq, m, d = q.shape
        self.shape = (b, hq, m)
        self.group = hq // hkv
        self.q = q.reshape(b, hkv, self.group * m, d)  # query head h*group + g pairs KV head h
        self.scaling = scaling
        rows = (b, hkv, self.group * m, 1)
        self.M = torch.full(rows, -math.inf, dtype=torch.float32, device=q.device)
        self.L = torch.zeros(rows, dtype=torch.float32, device=q.device)
        self.O: torch.Tensor | None = None
        self.peak_bytes = 0
        self.fused = FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32

    def add(self, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> None:
        """k, v: [b, h, n, d]; allowed: [b, 1 or m, n] bool (a key each query may attend)."""
        n = k.shape[-2]
        if n == 0:
            return
        if self.fused and allowed.shape[1] == 1 and k.dtype == torch.float32:
            self._add_fused(k, v, allowed)
            return
        b, hq, m = self.shape
        hkv = k.shape[1]
        s = torch.matmul(self.q, k.transpose(-1, -2)).float().mul_(self.scaling)  # [b, h, group*m, n]
        s = s.view(b, hkv, self.group, m, n).masked_fill_(~allowed[:, None, None], -math.inf).view(b, hkv, -1, n)
        top = torch.maximum(self.M, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that saw nothing yet
        alpha = torch.exp(self.M - safe)
        p = torch.exp(s.sub_(safe))
        self.L = self.L * alpha + p.sum(-1, keepdim=True)
        pv = torch.matmul(p, v.float())  # [b, h, group*m, d]
        self.O = pv if self.O is None else self.O.mul_(alpha).add_(pv)
        self.M = top
        self.peak_bytes = max(self.peak_bytes, s.nbytes + k.nbytes + v.nbytes + pv.nbytes)

    def _add_fused(self, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> None:
        """`add` of a part every query sees alike (allowed [b, 1, n]) by the fused kernel: its
        output o and log-sum-exp lse per query join the running sums as one tile would
        (exp(lse) weighs o)."""
        every = bool(allowed.all())
        # additive, [b, 1, 1, n]: the kernel takes a mask of the queries' dtype
        mask = None if every else bias_from_valid(allowed[:, 0], torch.float32)[:, :, None, :]
        assert FLASH_CPU is not None
        o, lse = FLASH_CPU(self.q, k, v, 0.0, False, attn_mask=mask, scale=self.scaling)  # [b, h, rows, (d)]
        lse = lse.unsqueeze(-1)
        if not every:  # a query that sees none of the part: the kernel gives lse 0, which is no mass
            lse = lse.masked_fill(~allowed.any(-1)[:, :, None, None], -math.inf)
        self._merge(o, lse)
        self.peak_bytes = max(self.peak_bytes, k.nbytes + v.nbytes + o.nbytes)

    def add_causal(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The queries' own keys k, v [b, h, m, d], query i seeing keys 0..i, every one valid:
        by the fused kernel where `fused` (each KV head repeated for its group of query heads),
        else by `add` with the causal mask."""
        b, hq, m = self.shape
        if not (self.fused and k.dtype == torch.float32):
            self.add(k, v, torch.ones(m, m, dtype=torch.bool, device=k.device).tril().expand(b, m, m))
            return
        assert FLASH_CPU is not None
        hkv, d = k.shape[1], k.shape[-1]
        kk, vv = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)  # [b, Hq, m, d]
        o, lse = FLASH_CPU(self.q.reshape(b, hq, m, d), kk, vv, 0.0, True, scale=self.scaling)
        self._merge(o.reshape(b, hkv, self.group * m, d), lse.reshape(b, hkv, self.group * m, 1))
        self.peak_bytes = max(self.peak_bytes, kk.nbytes + vv.nbytes + o.nbytes)

    def _merge(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        """A part's attention o [b, h, rows, d] (fp32) with its log-sum-exp lse [b, h, rows, 1]
        (-inf: the row saw none of it) joins the running sums (exp(lse) weighs o)."""
        top = torch.maximum(self.M, lse)
        safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that saw nothing yet
        alpha = torch.exp(self.M - safe)
        beta = torch.exp(lse - safe)
        self.L = self.L * alpha + beta
        ob = o.mul_(beta)
        self.O = ob if self.O is None else self.O.mul_(alpha).add_(ob)
        self.M = top

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """-> [b, Hq, m, d] in `dtype`."""
        assert self.O is not None, "at least one part with a key every query sees"
        b, hq, m = self.shape
        return (self.O / self.L).reshape(b, hq, m, -1).to(dtype)  # the kernel's parts may be strided


# The most a streamed prompt's run of scores may take (one layer at a time).
STREAM_SCORE_BYTES = 64 << 20


def attend_streamed(
    layer: FlashLayer,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    valid_new: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """A prompt chunk q [b, Hq, m, d] over every earlier token, read from the layer's tiers
    (sealed blocks streamed from the cold tier in runs), and over itself, causal -> [b, Hq, m, d].
    k_new, v_new: [b, h, m, d]; valid_new: [b, m]."""
    b, hkv, m, _ = k_new.shape
    acc = OnlineSoftmax(q, hkv, scaling)
    valid = layer.valid
    S = layer.block_start
    acc.add(layer.sink_k, layer.sink_v, valid[:, None, :S])
    B = layer.cfg.hca_chunk_size
    # About one chunk's tokens per run, fewer where the run's fp32 scores [b, Hq, m, run] would
    # pass STREAM_SCORE_BYTES: the transient stays bounded whatever the chunk (4096-token chunks
    # of a tiny model's prompt held 281 MB of scores, 4x its full cache at 8K).
    per_token = b * q.shape[1] * m * 4
    run_blocks = max(1, min(-(-layer.cfg.prefill_chunk // B), STREAM_SCORE_BYTES // (per_token * B)))
    for j0, j1, k, v in layer.reader.stream_runs(layer.num_sealed, run_blocks):
        acc.add(k, v, valid[:, None, S + j0 * B : S + j1 * B])
        del k, v  # the run leaves the device before the next but one arrives
    a = S + layer.num_sealed * B
    for k, v in zip(*layer.tail_parts()):  # the open block, then the window (one part while joined)
        acc.add(k, v, valid[:, None, a : a + k.shape[-2]])
        a += k.shape[-2]
    if acc.fused and bool(valid_new.all()):  # the chunk's own keys, no padding among them
        acc.add_causal(k_new, v_new)
    else:
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        eye = torch.eye(m, dtype=torch.bool, device=q.device)  # each sees itself, so no row is empty
        cols = max(1, STREAM_SCORE_BYTES // per_token)  # the chunk's own keys, in parts as the runs
        for c0 in range(0, m, cols):
            c1 = min(m, c0 + cols)
            seen = (causal[None, :, c0:c1] & valid_new[:, None, c0:c1]) | eye[None, :, c0:c1]
            acc.add(k_new[:, :, c0:c1], v_new[:, :, c0:c1], seen)
    layer.exact.peak_transient_bytes = max(layer.exact.peak_transient_bytes, acc.peak_bytes)
    return acc.result(q.dtype)
