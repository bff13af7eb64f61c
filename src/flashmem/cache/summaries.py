"""The summary tiers: HCA entries of every sealed block and CSA entries of the near band.

A sealed block keeps one fused HCA entry (the whole block in one K/V entry) while
summaries are kept (`use_summaries`, or a scorer that ranks by them); the newest
`csa_band_tokens // B` blocks also keep their CSA entries (`csa_chunk_size` tokens in
one). Fusion weights come from the fusion rule over the layer's recent queries, keys
un-rotated to pre-RoPE, pooled and re-rotated (`compress/`). Attention reads an entry
only where none of its block's (or chunk's) pages is attended exactly. Off in the
recipe: at 1/8-1/32 their bytes buy more selected pages.

Shapes: entries [b, h, n, d]; counts (tokens an entry stands for) [b, n].
"""

from __future__ import annotations

from collections import deque

import torch

from flashmem.cache.assembly import Assembly, entry_bias
from flashmem.compress.chunk_fusion import fuse_chunks
from flashmem.compress.fusion import FusionContext, FusionRule
from flashmem.config import FlashMemoryConfig
from flashmem.rope import RopeRotator
from flashmem.sizing.budget import RECENT_QUERY_TOKENS

# (block id, CSA keys [b, h, per, d], values, counts [b, per]) of one near-band block
BandBlock = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


class SummaryTiers:
    def __init__(
        self, cfg: FlashMemoryConfig, rule: FusionRule, rotator: RopeRotator | None, empty: torch.Tensor
    ) -> None:
        """empty: a [b, h, 0, d] tensor of the layer's dtype and device."""
        self.cfg, self.rule, self.rotator = cfg, rule, rotator
        b = empty.shape[0]
        self.hca_k, self.hca_v = empty, empty  # empty unless cfg.keeps_hca_entries
        self.hca_cnt = torch.zeros(b, 0, dtype=torch.long, device=empty.device)
        self.csa_blocks: deque[BandBlock] = deque()
        self.recent_q: torch.Tensor | None = None  # the fusion rule's last queries [b, h, n, d]
        self.rebuild_band()

    def note_queries(self, queries: torch.Tensor, group: int) -> None:
        """Keep the last RECENT_QUERY_TOKENS query positions (queries: [b, h, q*group, d],
        token-major), which the fusion rule weighs tokens by; only while summaries are kept."""
        if not self.cfg.use_summaries:
            return
        n = RECENT_QUERY_TOKENS * group
        both = queries if self.recent_q is None else torch.cat([self.recent_q, queries], dim=-2)
        self.recent_q = both[:, :, -n:].clone() if both.shape[-2] > n else both

    def seal(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor,
        pos: torch.Tensor,
        first: int,
        scaling: float,
    ) -> None:
        """Summaries of newly sealed blocks first, first+1, ..: k, v [b, h, nb*B, d]; valid
        [b, nb*B]; pos [nb*B] their positions; scaling: the model's attention scale."""
        cfg = self.cfg
        if not cfg.keeps_hca_entries:
            return
        band_blocks = cfg.csa_band_blocks if cfg.use_summaries else 0
        logimp = self.rule.log_importance(k, FusionContext(self.recent_q, scaling))  # [b, h, T]
        hca = fuse_chunks(k, v, logimp, valid, pos, cfg.hca_chunk_size, self.rotator)
        self.hca_k = torch.cat([self.hca_k, hca.keys], dim=-2)
        self.hca_v = torch.cat([self.hca_v, hca.values], dim=-2)
        self.hca_cnt = torch.cat([self.hca_cnt, hca.counts], dim=-1)
        if band_blocks > 0:
            csa = fuse_chunks(k, v, logimp, valid, pos, cfg.csa_chunk_size, self.rotator)
            per = cfg.csa_per_block
            for j in range(k.shape[-2] // cfg.hca_chunk_size):
                sl = slice(j * per, (j + 1) * per)
                self.csa_blocks.append((first + j, csa.keys[:, :, sl], csa.values[:, :, sl], csa.counts[:, sl]))
        while len(self.csa_blocks) > band_blocks:
            self.csa_blocks.popleft()  # aged out of the near band: only the HCA entry stays
        self.rebuild_band()

    def rebuild_band(self) -> None:
        """The near band's resident CSA entries, from `csa_blocks`, and the page each lies in."""
        blocks = list(self.csa_blocks)
        dev = self.hca_k.device
        if not blocks:
            self.csa_k = self.csa_v = self.hca_k[:, :, :0]
            self.csa_cnt = self.hca_cnt[:, :0]
            self.csa_page_ids = torch.zeros(0, dtype=torch.long, device=dev)
            return
        self.csa_k = torch.cat([blk[1] for blk in blocks], dim=-2)
        self.csa_v = torch.cat([blk[2] for blk in blocks], dim=-2)
        self.csa_cnt = torch.cat([blk[3] for blk in blocks], dim=-1)
        cfg = self.cfg
        ids = torch.tensor([blk[0] for blk in blocks], dtype=torch.long, device=dev)
        # The page each CSA entry lies in (pages are whole multiples of CSA chunks).
        within = torch.arange(cfg.csa_per_block, device=dev) * cfg.csa_chunk_size // cfg.page_tokens
        self.csa_page_ids = (ids[:, None] * cfg.pages_per_block + within[None]).reshape(-1)

    def add_to(self, asm: Assembly, selected: torch.Tensor, n: int) -> None:
        """Far blocks (out of the near band) attend their HCA entry, near ones their CSA
        entries, unless a page of theirs is attended exactly. selected: [b, h, pages] of the
        n sealed blocks."""
        cfg = self.cfg
        if not cfg.use_summaries:
            return
        touched = selected.view(asm.b, asm.hkv, n, cfg.pages_per_block).any(-1)
        far = torch.arange(n, device=selected.device) < n - len(self.csa_blocks)
        asm.add(self.hca_k, self.hca_v, entry_bias(self.hca_cnt, far & ~touched, cfg.summary_bias, asm.dtype))
        if self.csa_k.shape[-2]:
            use = ~selected.gather(-1, self.csa_page_ids.expand(asm.b, asm.hkv, -1))
            asm.add(self.csa_k, self.csa_v, entry_bias(self.csa_cnt, use, cfg.summary_bias, asm.dtype))

    def entries(self) -> int:
        """Fused entries `add_to` assembles (hidden where their blocks are attended exactly, but
        written into attention's buffers all the same)."""
        return self.hca_k.shape[-2] + self.csa_k.shape[-2] if self.cfg.use_summaries else 0

    def nbytes(self) -> dict[str, int]:
        return {
            "csa_entries": self.csa_k.nbytes + self.csa_v.nbytes,
            "hca_entries": self.hca_k.nbytes + self.hca_v.nbytes,
            "query_buffer": 0 if self.recent_q is None else self.recent_q.nbytes,
        }
