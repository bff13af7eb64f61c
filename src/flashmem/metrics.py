"""Fidelity of a cache's next-token distributions against the full cache's."""

from __future__ import annotations

import math

import torch


def kl_per_token(ref_lp: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(full || cache) per position. ref_lp, lp: log-probs [N, vocab] -> [N] (>= 0)."""
    return (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0)


def fidelity_metrics(ref_lp: torch.Tensor, lp: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """KL(full || method) per token, top-1 agreement, perplexities and their difference.
    ref_lp, lp: [N, vocab] log-probs; target: the N tokens that followed."""
    kl = kl_per_token(ref_lp, lp)
    agree = (ref_lp.argmax(-1) == lp.argmax(-1)).float()
    t = target.reshape(-1)
    nll_ref = -ref_lp.gather(-1, t[:, None]).squeeze(-1)
    nll = -lp.gather(-1, t[:, None]).squeeze(-1)
    ppl_ref = math.exp(float(nll_ref.mean()))
    ppl = math.exp(float(nll.mean()))
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agree": float(agree.mean()),
        "ppl_full": ppl_ref,
        "ppl": ppl,
        "ppl_diff": ppl - ppl_ref,
    }
