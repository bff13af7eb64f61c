"""Low-rank per-token scorer (the seed's MLA step, applied to the index).

Each sealed token's key is kept resident as r numbers: its projection on the
calibrated key basis U ([r, d], the top principal directions of the layer's
post-RoPE keys, `flashmem calibrate`), in `lsa_index_dtype` (int8 by default in
the recipe). A query is projected by the same U, so (U q).(U k) approximates
q.k with the query keeping its full dimension until the projection (Loki,
ShadowKV and Palu do the same post hoc). A page's score is the log-sum-exp of
its tokens' scores: softmax over pages of that is exactly the attention mass
the approximate scores give each page.
"""

from __future__ import annotations

import torch

from flashmem.errors import ConfigError
from flashmem.index.base import BlockScorer, ScorerContext


class LowRankScorer(BlockScorer):
    name = "lowrank"
    vectors = 0  # one vector per token of a page: set from the config at construction
    query_key = "key_basis"  # calibration tensors that project queries and keys
    key_key = "key_basis"

    def __init__(self, ctx: ScorerContext | None = None) -> None:
        super().__init__(ctx)
        if ctx is None or ctx.calibration is None:
            raise ConfigError(
                f"lsa_scorer: {self.name!r} needs a calibration of this model's layer "
                f"{None if ctx is None else ctx.layer_idx}; allowed: set `calibration:` to a folder "
                "written by `flashmem calibrate`, or build the config with FlashMemoryConfig.for_budget"
            )
        cal = ctx.calibration
        r = ctx.cfg.low_rank_dim or cal[self.key_key].shape[1]
        if r > cal[self.key_key].shape[1]:
            raise ConfigError(
                f"low_rank_dim: {r} exceeds the calibration's rank {cal[self.key_key].shape[1]}; "
                f"allowed: 1..{cal[self.key_key].shape[1]} or a calibration fitted with a larger --rank"
            )
        # [Hkv, r, d]: truncating a PCA basis keeps its top directions
        self.q_proj = cal[self.query_key][:, :r].float()
        self.k_proj = cal[self.key_key][:, :r].float()
        self.vectors = ctx.cfg.page_tokens
        self.rank = r

    @property
    def width(self) -> int:
        return self.rank

    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """keys [b, h, P, d] -> projected keys [b, h, P, r]; padding takes the page's mean
        so it neither wins nor dilutes (its score equals the average token's)."""
        w = valid[:, None, :, None].to(keys.dtype)
        mean = (keys * w).sum(-2, keepdim=True) / w.sum(-2, keepdim=True).clamp_min(1)
        keys = torch.where(w.bool(), keys, mean)
        proj = self.k_proj.to(keys.device, keys.dtype)  # [h, r, d]
        return torch.einsum("bhpd,hrd->bhpr", keys, proj)

    def score(self, queries: torch.Tensor, summaries: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        s = queries.shape[-1] ** -0.5 if scaling is None else scaling
        proj = self.q_proj.to(queries.device, queries.dtype)
        q = torch.einsum("bhqd,hrd->bhqr", queries, proj)  # [b, h, nq, r]
        logits = torch.einsum("bhqr,bhnpr->bhqnp", q.float(), summaries.float()) * s  # [b, h, nq, n, P]
        return (torch.logsumexp(logits, dim=-1) / s).to(queries.dtype)  # [b, h, nq, n]
