"""Fit the index's projections for one attention layer from captured queries and keys.

Two fits per KV head, both in the post-RoPE space attention scores live in:

* `key_basis` [r, d]: the top-r principal directions of the keys (uncentred
  second moment), as Loki does. The `lowrank` scorer keeps each token's key
  projected on it and scores (U q).(U k): the query keeps its full dimension
  until the projection, as in MLA.
* `query_proj`, `key_proj` [r, d]: the LSA indexer (a linear dual encoder).
  Initialised in closed form to minimise the expected error of q.k over the
  calibration pairs (keys whitened by the query second moment, then PCA), then
  trained so that its distribution over history pages matches the model's own
  attention mass over the same pages (KL, as DeepSeek-V3.2 warms up its
  lightning indexer against dense attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerFit:
    key_basis: torch.Tensor  # [Hkv, r, d]
    query_proj: torch.Tensor  # [Hkv, r, d]
    key_proj: torch.Tensor  # [Hkv, r, d]
    train_kl: list[float]  # indexer KL per KV head: [start, end]


def key_pca(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """keys [N, d] -> the top-`rank` eigenvectors of E[k k^T] as rows [rank, d]."""
    cov = keys.T @ keys / max(1, keys.shape[0])
    _, vecs = torch.linalg.eigh(cov.double())
    return vecs.flip(-1)[:, :rank].T.float().contiguous()


def qk_init(queries: torch.Tensor, keys: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form rank-r dual encoder: q.k ~ (A q).(B k).

    With Cq = E[q q^T], q.k = (Cq^-1/2 q).(Cq^1/2 k); the whitened query has identity
    second moment, so the rank-r truncation with the least expected squared error
    keeps the top principal directions V of Cq^1/2 k: A = V^T Cq^-1/2, B = V^T Cq^1/2.
    """
    cq = (queries.T @ queries / max(1, queries.shape[0])).double()
    ev, vec = torch.linalg.eigh(cq)
    ev = ev.clamp_min(float(ev.max()) * 1e-6)
    half = vec @ torch.diag(ev.sqrt()) @ vec.T
    inv_half = vec @ torch.diag(ev.rsqrt()) @ vec.T
    kw = keys.double() @ half
    _, v = torch.linalg.eigh(kw.T @ kw)
    v = v.flip(-1)[:, :rank]
    return (v.T @ inv_half).float(), (v.T @ half).float()


def page_mass(logits: torch.Tensor, visible: torch.Tensor, page: int) -> torch.Tensor:
    """Attention mass per page: logits [..., nq, T], visible [nq, T] -> [..., nq, T // page]."""
    n = logits.shape[-1] // page
    lg = logits[..., : n * page].masked_fill(~visible[..., : n * page], float("-inf"))
    p = torch.softmax(lg, dim=-1).nan_to_num(0.0)
    return p.reshape(*p.shape[:-1], n, page).sum(-1)


def train_indexer(
    seqs: list[tuple[torch.Tensor, torch.Tensor]],
    query_proj: torch.Tensor,
    key_proj: torch.Tensor,
    scaling: float,
    *,
    page: int,
    window: int,
    sinks: int,
    steps: int,
    queries_per_seq: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Minimise KL(dense page mass || indexer page mass) over sampled query positions.

    seqs: (queries [Hkv, G, T, d], each KV head's query group; keys [Hkv, T, d]);
    query_proj / key_proj: [Hkv, r, d], all KV heads trained at once. Only
    history the index ranks counts: after the sinks, before the recent window.
    The learned temperature ends up in the projections' scale.
    """
    gen = torch.Generator().manual_seed(seed)
    a = query_proj.clone().requires_grad_(True)
    b = key_proj.clone().requires_grad_(True)
    opt = torch.optim.Adam([a, b], lr=lr)
    batches = []
    for q, k in seqs:
        T = k.shape[-2]
        lo = sinks + window + 2 * page
        if T <= lo:
            continue
        t = torch.randint(lo, T, (queries_per_seq,), generator=gen)
        pos = torch.arange(T)
        visible = (pos[None] >= sinks) & (pos[None] < t[:, None] - window)  # [nq, T]
        qs = q[:, :, t]  # [Hkv, G, nq, d]
        with torch.no_grad():
            target = page_mass(qs @ k[:, None].transpose(-1, -2) * scaling, visible, page)  # [Hkv, G, nq, n]
        batches.append((qs, k, visible, target))
    if not batches:
        return query_proj, key_proj, [0.0, 0.0]

    def loss_fn() -> torch.Tensor:
        total = torch.zeros(())
        for qs, k, visible, target in batches:
            qa = qs @ a[:, None].transpose(-1, -2)  # [Hkv, G, nq, r]
            kb = k @ b.transpose(-1, -2)  # [Hkv, T, r]
            pm = page_mass(qa @ kb[:, None].transpose(-1, -2) * scaling, visible, page)
            kl = (target * (target.clamp_min(1e-12).log() - pm.clamp_min(1e-12).log())).sum(-1)
            total = total + kl.mean()
        return total / len(batches)

    history = []
    for step in range(steps):
        loss = loss_fn()
        if step == 0:
            history.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        history.append(loss_fn().item())
    return a.detach(), b.detach(), history


def fit_layer(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    scaling: float,
    *,
    rank: int,
    page: int,
    window: int,
    sinks: int,
    steps: int,
) -> LayerFit:
    """queries: per sequence [Hq, T, d]; keys: per sequence [Hkv, T, d] (post-RoPE)."""
    hkv, d = keys[0].shape[0], keys[0].shape[-1]
    group = queries[0].shape[0] // hkv
    rank = min(rank, d)
    basis, qp, kp = [], [], []
    for h in range(hkv):
        k_all = torch.cat([k[h] for k in keys])  # [N, d]
        q_all = torch.cat([q[h * group : (h + 1) * group].reshape(-1, d) for q in queries])
        basis.append(key_pca(k_all, rank))
        a0, b0 = qk_init(q_all, k_all, rank)
        qp.append(a0)
        kp.append(b0)
    seqs = [(q.reshape(hkv, group, *q.shape[1:]), k) for q, k in zip(queries, keys)]
    a, b, kl = train_indexer(
        seqs, torch.stack(qp), torch.stack(kp), scaling, page=page, window=window, sinks=sinks, steps=steps
    )
    return LayerFit(torch.stack(basis), a, b, kl)
