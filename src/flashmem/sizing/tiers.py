"""How many token-equivalents each tier holds after T tokens, for one managed layer.

This is the single definition of the FlashMemory layout's sizes, shared by the
calculator (`flashmem estimate --config`) and the cache's own bookkeeping, so
the two cannot drift apart. Counts are per sequence and per KV head; multiply
by (K bytes + V bytes) per token-equivalent to get bytes. The index's bytes are
what its scorer declares in `flashmem.policies.SCORERS` (`index_bytes`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flashmem import policies
from flashmem.config import RERANK_CODE_BITS, FlashMemoryConfig

# Key-sized vectors the index keeps per sealed block and KV head, per scorer.
INDEX_KEY_VECTORS = {name: s.vectors for name, s in policies.SCORERS.items()}


@dataclass(frozen=True)
class TierCounts:
    """Token-equivalents per tier (entries count as one token each)."""

    sinks: int
    window: int
    open_block: int  # history tokens not yet sealed: exact, resident
    csa_entries: int  # near band: sealed blocks behind the window, fused 4:1
    hca_entries: int  # one per sealed block
    working_set: int  # exact tokens of the blocks selected this step
    index_key_vectors: int  # key-sized vectors of the block index (its per-block part)
    sealed_blocks: int
    cold_tokens: int  # exact tokens held in the cold tier
    # exact tokens of pages kept past the selection (lsa_cache_pages), held as the working set is
    page_cache: int = 0

    @property
    def resident_kv(self) -> int:
        """Token-equivalents that carry both K and V on the device."""
        held = self.csa_entries + self.hca_entries + self.working_set + self.page_cache
        return self.sinks + self.window + self.open_block + held

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def tier_counts(cfg: FlashMemoryConfig, tokens: int, peak: bool = False) -> TierCounts:
    """Sizes of each tier after `tokens` tokens have been seen (steady state).

    peak: the open block counted full (B - 1 tokens, once there is that much history),
    as it is on some step near `tokens` whatever `tokens` mod B is: the most the
    device holds around that length, which is what a budget must bound.

    The window holds up to `gpu_cache_limit` tokens beyond the sinks; tokens
    pushed out of it fill the open block, sealed every `hca_chunk_size` tokens.
    The near band keeps CSA entries for the newest `cfg.csa_band_blocks`
    sealed blocks. The working set is the `blocks_to_select` blocks attended
    exactly this step.
    """
    B = cfg.hca_chunk_size
    sinks = min(cfg.sink_tokens, tokens)
    rest = tokens - sinks
    window = min(cfg.gpu_cache_limit, rest)
    history = rest - window
    sealed = history // B
    open_block = min(B - 1, history) if peak else history - sealed * B
    band_blocks = min(sealed, cfg.csa_band_blocks) if cfg.use_summaries else 0
    csa = band_blocks * cfg.csa_per_block
    pages = sealed * cfg.pages_per_block
    selected = cfg.blocks_to_select(pages)  # pages (blocks unless paged)
    spare = max(0, min(cfg.lsa_cache_pages, pages - selected)) if selected else 0
    return TierCounts(
        sinks=sinks,
        window=window,
        open_block=open_block,
        csa_entries=csa,
        hca_entries=sealed if cfg.keeps_hca_entries else 0,
        working_set=selected * cfg.page_tokens,
        index_key_vectors=pages * INDEX_KEY_VECTORS[cfg.lsa_scorer],
        sealed_blocks=sealed,
        cold_tokens=sealed * B,
        page_cache=spare * cfg.page_tokens,
    )


def index_bytes(cfg: FlashMemoryConfig, counts: TierCounts, head_dim: int, dtype_bytes: int) -> float:
    """Device bytes of one KV head's block index: its scorer's declared bytes per
    sealed block and per token of the sealed blocks (flashmem.policies.SCORERS),
    plus the rest entry's value sum when it is kept."""
    per = policies.SCORERS[cfg.lsa_scorer].index_bytes(cfg, head_dim, dtype_bytes)
    rest = 4 * head_dim if cfg.keeps_rest_entry and counts.sealed_blocks else 0  # the fp32 value sum
    pages = counts.sealed_blocks * cfg.pages_per_block
    codes = candidate_code_bytes(cfg, pages, counts.working_set // cfg.page_tokens, head_dim, dtype_bytes)
    return counts.sealed_blocks * per.per_block + counts.cold_tokens * per.per_token + rest + codes


def rerank_candidates(cfg: FlashMemoryConfig, pages: int, selected: int) -> int:
    """Candidate pages a re-ranking step scores per KV head, of `pages` sealed ones with
    `selected` chosen: max(lsa_rerank x selected, lsa_rerank_min_pages), at most every
    page; 0 without a re-rank, or past lsa_rerank_max_tokens (cache/ranking.py)."""
    cap = cfg.lsa_rerank_max_tokens
    if cfg.lsa_rerank <= 1 or not selected or (cap is not None and pages * cfg.page_tokens > cap):
        return 0
    return min(pages, max(cfg.lsa_rerank * selected, cfg.lsa_rerank_min_pages))


def candidate_code_bytes(cfg: FlashMemoryConfig, pages: int, selected: int, head_dim: int, dtype_bytes: float) -> float:
    """Device bytes of one KV head's candidate codes (`lsa_rerank_on_device`): each candidate
    page's keys in lsa_rerank_codec's bits, with its block's zero and scale per channel
    (cache/rerank_codes.py holds them per page); 0 when the codes stay on the host."""
    if not cfg.lsa_rerank_on_device or cfg.lsa_rerank_codec == "exact":
        return 0.0
    n = rerank_candidates(cfg, pages, selected)
    per_page = cfg.page_tokens * head_dim * RERANK_CODE_BITS[cfg.lsa_rerank_codec] / 8 + head_dim * 4
    return n * per_page


def codec_bytes_per_element(codec: str, dtype_bytes: int) -> float:
    """Cold-tier bytes per K or V element under a codec, as it declares in
    `flashmem.policies.CODECS`."""
    return policies.lookup(policies.CODECS, "cold_codec", codec).bytes_per_element(dtype_bytes)


def working_set_bytes_per_element(codec: str, head_dim: int, dtype_bytes: float) -> float:
    """Device bytes of one working-set element (a K or V channel of one token) under
    `working_set_codec`: int8 codes plus one fp32 scale per row of head_dim
    (`flashmem.compress.page_code`), else the model's dtype."""
    if codec == "int8":
        return 1.0 + 4.0 / max(1, head_dim)
    return float(dtype_bytes)


def working_set_scale(cfg: FlashMemoryConfig, head_dim: int, dtype_bytes: float) -> float:
    """Bytes of a working-set token over a token at the model's dtype (1 unless coded)."""
    return working_set_bytes_per_element(cfg.working_set_codec, head_dim, dtype_bytes) / dtype_bytes
