"""Second stage of selection: candidate pages re-ranked by their exact keys.

The index ranks pages by a summary (a page's int8 mean key), which blurs a page
whose mass sits on one or two tokens (the digits of a key, a name): on the 2K
misses it ranked the needle's page 4th to 30th (docs/measurements.md, "What the
misses at 2K are"). With `lsa_rerank: r` the index picks r * k candidates, their
exact keys are read from the cold tier, and the k pages with the most exact
attention mass win (Quest's and ShadowKV's "over-select, then verify" idea).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashmem.compress import key_code
from flashmem.index.selection import pool_mass

# The re-rank decodes coded candidates (`lsa_rerank_codec`) this many key elements at a
# time: the transient is one chunk (8 MiB of bf16 keys), not every candidate's keys.
# Llama-3.1-8B at 128K and 1/16 has 1,024 candidates x 16 tokens x 8 heads x 128 per
# layer: decoded whole in fp32 that was 64 MiB per layer and sequence.
CODE_CHUNK_ELEMENTS = 1 << 22


def exact_page_mass(
    qg: torch.Tensor,
    cand_k: torch.Tensor,
    cand_valid: torch.Tensor,
    scaling: float,
    pool: str = "mean",
    share_heads: bool = False,
) -> torch.Tensor:
    """Each query's softmax over the candidates' tokens, summed per page and pooled
    over queries (as select_blocks pools the index's page distributions).

    qg: [b, h, nq, d] queries grouped by KV head; cand_k: [b, h, c, P, d] candidate
    pages' keys; cand_valid: [b, h, c, P] -> mass [b, h, c].
    """
    b, h, c, P, d = cand_k.shape
    logits = torch.matmul(qg, cand_k.reshape(b, h, c * P, d).transpose(-1, -2))
    return _page_mass(logits, cand_valid.reshape(b, h, 1, c * P), P, scaling, pool, share_heads)


def coded_page_mass(
    qg: torch.Tensor,
    code: key_code.KeyCode,
    cand_valid: torch.Tensor,
    scaling: float,
    pool: str = "mean",
    share_heads: bool = False,
    slots: torch.Tensor | None = None,
    chunk_elements: int = CODE_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """exact_page_mass with the candidates' keys as codes (compress/key_code.py), decoded
    in qg's dtype a chunk of candidates at a time (`CODE_CHUNK_ELEMENTS`).

    qg: [b, h, nq, d]; code: q [b, h, S, P, w], zero / scale [b, h, S, 1, d], the
    candidates' codes in order, or held in slots with slots [b, h, c] each candidate's;
    cand_valid: [b, h, c, P] -> mass [b, h, c]. Only the logits [b, h, nq, c * P]
    (nq / d of the keys' elements) are held whole, for one softmax over every candidate.
    """
    b, h, _, P, w = code.q.shape
    d = code.zero.shape[-1]
    step = max(1, chunk_elements // max(1, b * h * P * d))

    def keys_of(s: int, e: int) -> torch.Tensor:
        if slots is None:
            part = key_code.KeyCode(code.q[:, :, s:e], code.zero[:, :, s:e], code.scale[:, :, s:e], code.bits)
        else:  # this chunk's candidates gathered from their slots: a chunk-sized copy
            at = slots[:, :, s:e, None, None]
            part = key_code.KeyCode(
                code.q.gather(2, at.expand(b, h, e - s, P, w)),
                code.zero.gather(2, at.expand(b, h, e - s, 1, d)),
                code.scale.gather(2, at.expand(b, h, e - s, 1, d)),
                code.bits,
            )
        return key_code.decode(part, qg.dtype)

    mass = streamed_page_mass(qg, keys_of, cand_valid, scaling, pool, share_heads, step)
    assert mass is not None
    return mass


def streamed_page_mass(
    qg: torch.Tensor,
    keys_of: Callable[[int, int], torch.Tensor | None],
    cand_valid: torch.Tensor,
    scaling: float,
    pool: str = "mean",
    share_heads: bool = False,
    step: int = 1,
) -> torch.Tensor | None:
    """exact_page_mass with the candidates' keys taken `step` candidates at a time:
    keys_of(s, e) -> keys [b, h, e - s, P, d] of candidates s..e-1 (decoded codes, or read from
    the cold tier), or None where they cannot be had (then None). Each chunk's keys are
    dropped once scored: only the logits [b, h, nq, c * P] are held whole (nq / d of the
    keys' elements), for one softmax over every candidate. qg: [b, h, nq, d]; cand_valid:
    [b, h, c, P] -> mass [b, h, c]."""
    b, h, c, P = cand_valid.shape
    nq = qg.shape[2]
    logits = torch.empty(b, h, nq, c * P, dtype=torch.float32, device=qg.device)
    for s in range(0, c, step):
        e = min(c, s + step)
        k = keys_of(s, e)
        if k is None:
            return None
        logits[..., s * P : e * P] = torch.matmul(qg, k.reshape(b, h, (e - s) * P, -1).transpose(-1, -2))
        del k
    return _page_mass(logits, cand_valid.reshape(b, h, 1, c * P), P, scaling, pool, share_heads)


def exact_block_mass(
    qg: torch.Tensor,
    block_k: torch.Tensor,
    tokens_valid: torch.Tensor,
    page_tokens: int,
    scaling: float,
    pool: str = "mean",
    share_heads: bool = False,
) -> torch.Tensor:
    """exact_page_mass with every page a candidate, from the blocks as the store holds
    them: qg [b, h, nq, d]; block_k [n, b, h, B, d] (a view of the store's arena: one
    batched matmul over the blocks, no copy of n * B keys into page order);
    tokens_valid [b, 1 or h, n*B] -> mass [b, h, n*B / page_tokens]."""
    n, b, h, B, d = block_k.shape
    logits = torch.matmul(qg[None], block_k.transpose(-1, -2))  # [n, b, h, nq, B]
    logits = logits.permute(1, 2, 3, 0, 4).reshape(b, h, qg.shape[2], n * B)
    return _page_mass(logits, tokens_valid[:, :, None, :], page_tokens, scaling, pool, share_heads)


def token_page_mass(
    logits: torch.Tensor,
    tokens_valid: torch.Tensor,
    page_tokens: int,
    scaling: float,
    pool: str = "mean",
    share_heads: bool = False,
) -> torch.Tensor:
    """exact_block_mass from logits already scored: logits [b, h, nq, L] (every sealed token
    in order, e.g. by a host mirror of the keys: cache/rerank_codes.py KeyMirror), times
    `scaling`; tokens_valid [b, 1 or h, L] -> mass [b, h, L / page_tokens].

    fp32 logits laid out query-major (contiguous) or token-major (the transpose of a
    contiguous [b, h, L, nq]) are worked on in that layout, in place (they are the caller's
    to give up): the softmax over the tokens runs along whichever dim they are contiguous in,
    not over a transposed copy."""
    b, h, nq, L = logits.shape
    by_token = logits.transpose(-1, -2)  # [b, h, L, nq]
    if logits.dtype != torch.float32 or not (logits.is_contiguous() or by_token.is_contiguous()):
        return _page_mass(logits, tokens_valid[:, :, None, :], page_tokens, scaling, pool, share_heads)
    query_major = logits.is_contiguous()
    if scaling != 1.0:
        logits.mul_(scaling)
    every = bool(tokens_valid.all())
    if not every:
        logits.masked_fill_(~tokens_valid[:, :, None, :], float("-inf"))
    if query_major:
        probs = torch.softmax(logits, dim=-1)
    else:
        probs = torch.softmax(by_token, dim=-2).transpose(-1, -2)  # along the tokens, in their layout
    if not every:
        probs.nan_to_num_(0.0)
    if query_major:
        per_page = probs.view(b, h, nq, L // page_tokens, page_tokens).sum(-1)  # [b, h, nq, pages]
    else:
        per_page = probs.transpose(-1, -2).view(b, h, L // page_tokens, page_tokens, nq).sum(-2).transpose(-1, -2)
    return pool_mass(per_page, pool, share_heads)


def _page_mass(
    logits: torch.Tensor, valid: torch.Tensor, P: int, scaling: float, pool: str, share_heads: bool
) -> torch.Tensor:
    """Token logits [b, h, nq, L] (L = pages * P), valid broadcastable to them -> mass [b, h, pages]."""
    b, h, nq, L = logits.shape
    logits = (logits.float() * scaling).masked_fill_(~valid, float("-inf"))  # in place: one temporary
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0).view(b, h, nq, L // P, P).sum(-1)  # [b, h, nq, pages]
    return pool_mass(probs, pool, share_heads)
