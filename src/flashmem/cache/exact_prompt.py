"""The exact prompt (`prefill_exact_tokens`): a prompt attends every earlier token, as the full cache does.

While the context, with the forward, is within `prefill_exact_tokens`, a prompt
forward (more than one token, before the first one-token forward) attends every
earlier token exactly instead of its selection. The layer keeps the prompt's
K/V in a growing buffer; the tiers fill as usual. The buffer is dropped for good
at the first one-token forward, or when the context passes the cap: from there
on every chunk attends its selection.

Shapes: the buffer is [b, h, capacity, d]; queries [b, Hq, m, d].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashmem.cache.assembly import step_scratch


class ExactPrompt:
    def __init__(self, cap_tokens: int) -> None:
        self.cap = cap_tokens
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0  # tokens in the buffer
        self.want = 0  # tokens the current prompt forward brings the buffer to
        self.open = cap_tokens > 0

    def admits(self, q: int, seen: int) -> bool:
        """Whether a forward of q new tokens after `seen` tokens attends every earlier token.
        Otherwise the prompt's K/V is dropped for good."""
        if not self.open:
            return False
        if q > 1 and seen + q <= self.cap and self.length == seen:
            self.want = seen + q
            return True
        self.open = False
        self.k = self.v = None
        return False

    def resume(self, seen: int, every_token: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After a restored state (serve's prefix reuse): rebuild the prompt's K/V from the
        tiers (`every_token()`: every token's K/V in order, [b, h, seen, d] each), so an exact
        prompt goes on as a fresh prefill would. Nothing to do when closed or past the cap."""
        if not self.open or seen > self.cap or seen == self.length:
            return
        k, v = every_token()
        assert k.shape[-2] == seen, "the tiers hold every token seen"
        self.k, self.v, self.length = k.contiguous(), v.contiguous(), seen

    def nbytes(self) -> int:
        """Bytes the buffer holds (its capacity)."""
        return sum(t.nbytes for t in (self.k, self.v) if t is not None)

    def read_bytes(self) -> int:
        """Bytes of the K/V an attention over the whole prompt so far reads."""
        if self.k is None:
            return 0
        return 2 * self.k[:, :, : self.length].nbytes

    def attend(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, valid: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """A prompt chunk q [b, Hq, m, d] over every earlier token and itself, causal, as the
        full cache attends -> [b, Hq, m, d]. The chunk joins the prompt's K/V first.
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
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] > hkv)
