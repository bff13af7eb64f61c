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

One more fit per KV head for the cold tier's low-rank layout (`cold_low_rank`,
`flashmem.cache.latent`), over every rank at once (any `low_rank_dim` <= d
truncates it):

* `key_basis_pre` [d, d]: principal directions (uncentred) of the PRE-RoPE keys,
  descending. Before RoPE a head's keys share a few directions at every
  position; after it each position turns them differently, so the post-RoPE
  keys spread over more directions (SmolLM2: docs/measurements.md, "Low-rank
  cold tier").
* `value_basis` [d, d]: the same for the values.
* `key_energy_pre`, `value_energy` [d]: the eigenvalues (mean squared coefficient
  along each direction): the expected reconstruction error at rank r is the sum
  past r.
"""

from __future__ import annotations

from collections.abc import Callable
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
    return second_moment_basis(keys)[0][:rank].contiguous()


def second_moment_basis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] -> every eigenvector of E[x x^T] as rows [d, d], descending, and the
    eigenvalues [d] (clamped at 0)."""
    cov = (x.T.double() @ x.double()) / max(1, x.shape[0])
    ev, vecs = torch.linalg.eigh(cov)
    return vecs.flip(-1).T.float().contiguous(), ev.flip(-1).clamp_min(0).float().contiguous()


@dataclass
class ColdBases:
    key_basis_pre: torch.Tensor  # [Hkv, d, d], rows descending
    key_energy_pre: torch.Tensor  # [Hkv, d]
    value_basis: torch.Tensor  # [Hkv, d, d]
    value_energy: torch.Tensor  # [Hkv, d]
    key_enc_pre: torch.Tensor | None = None  # [Hkv, d, d] attention-weighted encoder rows, descending
    key_dec_pre: torch.Tensor | None = None  # [Hkv, d, d] its decoder rows: k_hat = dec[:r]^T (enc[:r] k)


def logit_weighted_basis(keys: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-r key code with the least expected logit error E[(q.(k - k_hat))^2]
    over pairs of calibration queries and keys (both pre-RoPE: RoPE is a rotation, so
    the logit error is the same before and after it), for every r at once.

    With S = E[q q^T]^(1/2) and V the eigenvectors of S E[k k^T] S (descending), the
    encoder is V^T S and the decoder S^-1 V (as `qk_init`): the key error is weighted by
    how much queries look along it. keys [N, d], queries [M, d] -> enc, dec [d, d] rows.
    """
    cq = (queries.T.double() @ queries.double()) / max(1, queries.shape[0])
    ev, vec = torch.linalg.eigh(cq)
    ev = ev.clamp_min(float(ev.max()) * 1e-6)
    half = vec @ torch.diag(ev.sqrt()) @ vec.T
    inv_half = vec @ torch.diag(ev.rsqrt()) @ vec.T
    ck = (keys.T.double() @ keys.double()) / max(1, keys.shape[0])
    _, v = torch.linalg.eigh(half @ ck @ half)
    v = v.flip(-1)
    return (v.T @ half).float().contiguous(), (inv_half @ v).T.float().contiguous()


def fit_cold_bases(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    unrotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    skip: int = 0,
    queries: list[torch.Tensor] | None = None,
) -> ColdBases:
    """keys (post-RoPE), values: per sequence [Hkv, T, d]; queries (post-RoPE, optional):
    per sequence [Hq, T, d]; token t at position t (each calibration sequence starts at
    0); unrotate(x [.., T, d], pos [T]) undoes RoPE. The first `skip` tokens of each
    sequence (the sinks, never in the cold tier) are left out. With queries, the
    attention-weighted key code (`logit_weighted_basis`) is fitted too, a KV head's
    GQA group pooled."""
    pre = [unrotate(k, torch.arange(k.shape[-2]))[:, skip:] for k in keys]
    vals = [v[:, skip:] for v in values]
    hkv = keys[0].shape[0]
    qpre = None
    if queries is not None:
        qpre = [unrotate(q, torch.arange(q.shape[-2]))[:, skip:] for q in queries]
    group = 1 if queries is None else queries[0].shape[0] // hkv
    out: dict[str, list[torch.Tensor]] = {"kb": [], "ke": [], "vb": [], "ve": [], "enc": [], "dec": []}
    for h in range(hkv):
        k_all = torch.cat([k[h] for k in pre])
        kb, ke = second_moment_basis(k_all)
        vb, ve = second_moment_basis(torch.cat([v[h] for v in vals]))
        for name, t in (("kb", kb), ("ke", ke), ("vb", vb), ("ve", ve)):
            out[name].append(t)
        if qpre is not None:
            q_all = torch.cat([q[h * group : (h + 1) * group].reshape(-1, q.shape[-1]) for q in qpre])
            enc, dec = logit_weighted_basis(k_all, q_all)
            out["enc"].append(enc)
            out["dec"].append(dec)
    st = {n: torch.stack(ts) for n, ts in out.items() if ts}
    return ColdBases(st["kb"], st["ke"], st["vb"], st["ve"], st.get("enc"), st.get("dec"))


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
    batches = _indexer_batches(seqs, scaling, page, window, sinks, queries_per_seq, gen)
    if not batches:
        return query_proj, key_proj, [0.0, 0.0]

    def loss_fn() -> torch.Tensor:
        return _indexer_kl(batches, a, b, scaling, page)

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


_Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # queries, keys, visible, dense page mass


def _indexer_batches(
    seqs: list[tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
    page: int,
    window: int,
    sinks: int,
    queries_per_seq: int,
    gen: torch.Generator,
) -> list[_Batch]:
    """Per sequence long enough: `queries_per_seq` sampled query positions, their keys, what
    each may see, and the dense attention's page mass (the target)."""
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
    return batches


def _indexer_kl(batches: list[_Batch], a: torch.Tensor, b: torch.Tensor, scaling: float, page: int) -> torch.Tensor:
    """Mean KL(dense page mass || page mass of the projections a [Hkv, r, d], b [Hkv, r, d])."""
    total = torch.zeros(())
    for qs, k, visible, target in batches:
        qa = qs @ a[:, None].transpose(-1, -2)  # [Hkv, G, nq, r]
        kb = k @ b.transpose(-1, -2)  # [Hkv, T, r]
        pm = page_mass(qa @ kb[:, None].transpose(-1, -2) * scaling, visible, page)
        kl = (target * (target.clamp_min(1e-12).log() - pm.clamp_min(1e-12).log())).sum(-1)
        total = total + kl.mean()
    return total / len(batches)


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
