"""One registry per policy kind: scorers, fusion rules, cold codecs, cold stores.

Torch-free on purpose: config validation, `flashmem estimate` and
`flashmem config check` read the names and declared numbers here without
importing torch. Each entry names the class that implements it
("module:Class"), imported only when a cache is built; `tests/test_policies.py`
checks that the numbers declared here equal what those classes declare.

Adding a scorer: one file under `flashmem/index/`, one `ScorerSpec` line in
`SCORERS` below, and its tests (the cache and index tests are parametrised
over `SCORERS`). The same holds for a fusion rule, a codec or a store.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashmem.config import FlashMemoryConfig


@dataclass(frozen=True)
class IndexBytes:
    """Device bytes a scorer's index keeps per KV head: per sealed block, plus per
    token of the sealed blocks (a per-token index such as low-rank keys)."""

    per_block: float
    per_token: float = 0  # int 0 keeps integer byte counts integers


def vector_bytes(cfg: FlashMemoryConfig, width: int, dtype_bytes: int) -> float:
    """Bytes of one resident index vector of `width` elements under `lsa_index_dtype`
    (int8: one byte per element plus an fp16 scale per vector)."""
    if cfg.lsa_index_dtype == "int8":
        return width + 2
    return width * (2 if cfg.lsa_index_dtype == "float16" else dtype_bytes)


def key_vectors(n: int) -> Callable[[FlashMemoryConfig, int, int], IndexBytes]:
    """The index bytes of a scorer that keeps `n` key-sized vectors per page (per block
    unless `lsa_page_tokens` is set)."""

    def index_bytes(cfg: FlashMemoryConfig, head_dim: int, dtype_bytes: int) -> IndexBytes:
        return IndexBytes(per_block=n * cfg.pages_per_block * vector_bytes(cfg, head_dim, dtype_bytes))

    return index_bytes


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    impl: str  # "module:Class", a flashmem.index.base.BlockScorer
    # key-sized vectors per sealed block and KV head (0: none, e.g. reads HCA entries);
    # the summary tensor's width. Scorers with another layout set index_bytes.
    vectors: int
    index_bytes: Callable[[FlashMemoryConfig, int, int], IndexBytes]
    needs_calibration: bool = False  # reads projections fitted by `flashmem calibrate`
    scores_pages: bool = True  # False: ranks whole blocks only (lsa_page_tokens must be unset)
    reads_hca_entries: bool = False  # scores the HCA entries (kept resident even without summaries)


@dataclass(frozen=True)
class CodecSpec:
    name: str
    impl: str  # "module:Class", a flashmem.store.codecs.base.Codec
    # cold bytes per K or V element as a function of the model dtype's bytes
    bytes_per_element: Callable[[int], float]


@dataclass(frozen=True)
class PolicySpec:
    """A policy that declares nothing beyond its implementation: fusion rules
    ("module:Class") and cold stores ("module:opener", (cfg, *, dtype, name) -> ColdStore)."""

    name: str
    impl: str
    needs_dir: bool = False  # cold stores: requires cold_dir


def low_rank_tokens(cfg: FlashMemoryConfig, head_dim: int, dtype_bytes: int) -> IndexBytes:
    """Per-token low-rank keys: `low_rank_dim` numbers per token (16 when unset: the
    calibration's default rank)."""
    return IndexBytes(per_block=0, per_token=vector_bytes(cfg, cfg.low_rank_dim or 16, dtype_bytes))


def _scorer(name: str, impl: str, vectors: int) -> ScorerSpec:
    return ScorerSpec(name, impl, vectors, key_vectors(vectors))


SCORERS: dict[str, ScorerSpec] = {
    s.name: s
    for s in (
        _scorer("quest", "flashmem.index.quest:QuestScorer", 2),
        _scorer("mean_key", "flashmem.index.mean_key:MeanKeyScorer", 1),
        ScorerSpec(
            "hca_key",
            "flashmem.index.hca_key:HcaKeyScorer",
            0,
            key_vectors(0),
            scores_pages=False,
            reads_hca_entries=True,
        ),
        _scorer("gaussian", "flashmem.index.gaussian:GaussianScorer", 2),
        ScorerSpec("lowrank", "flashmem.index.lowrank:LowRankScorer", 0, low_rank_tokens, needs_calibration=True),
        ScorerSpec("learned", "flashmem.index.learned:LearnedScorer", 0, low_rank_tokens, needs_calibration=True),
    )
}

FUSION_RULES: dict[str, PolicySpec] = {
    r.name: r
    for r in (
        PolicySpec("attention_mass", "flashmem.compress.fusion.attention_mass:AttentionMassRule"),
        PolicySpec("key_norm", "flashmem.compress.fusion.key_norm:KeyNormRule"),
        PolicySpec("mean", "flashmem.compress.fusion.mean:MeanRule"),
    )
}

# int8/int4 are KIVI-style with groups of 32 elements, each group carrying an
# fp16 scale and an fp16 zero point (4 bytes / 32 elements = 0.125 bytes).
CODECS: dict[str, CodecSpec] = {
    c.name: c
    for c in (
        CodecSpec("exact", "flashmem.store.codecs.exact:ExactCodec", lambda eb: float(eb)),
        CodecSpec("int8", "flashmem.store.codecs.int8:Int8Codec", lambda eb: 1.0 + 4 / 32),
        CodecSpec("int4", "flashmem.store.codecs.int4:Int4Codec", lambda eb: 0.5 + 4 / 32),
    )
}

COLD_STORES: dict[str, PolicySpec] = {
    s.name: s
    for s in (
        PolicySpec("memory", "flashmem.store:open_memory"),
        PolicySpec("disk", "flashmem.store:open_disk", needs_dir=True),
        PolicySpec("layered", "flashmem.store:open_layered", needs_dir=True),
        PolicySpec("lmdb", "flashmem.store:open_lmdb", needs_dir=True),
    )
}


def load(impl: str) -> Any:
    """The object an entry's "module:Class" names (imports its module)."""
    module, _, attr = impl.partition(":")
    return getattr(importlib.import_module(module), attr)


def lookup(registry: dict[str, Any], kind: str, name: str) -> Any:
    """registry[name], or a one-line ValueError naming the key and what is allowed."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"{kind}: {name!r} is not allowed; allowed: {', '.join(registry)}") from None
