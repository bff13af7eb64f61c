"""FlashMemoryConfig: every knob of the cache, loadable from YAML or keywords.

Keys follow the vocabulary of docs/design.md. The seed's YAML block
(`flash_memory:` with `gpu_cache_limit`, `csa_chunk_size`, `hca_chunk_size`,
`prefetch_window`, `keep_full_layers`) loads as written.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flashmem import policies
from flashmem.errors import ConfigError, FlashMemError

# Policy names come from the registries in flashmem.policies (one line adds one).
if TYPE_CHECKING:
    FusionRule: TypeAlias = str
    Scorer: TypeAlias = str
    ColdStoreKind: TypeAlias = str
    ColdCodec: TypeAlias = str
else:
    FusionRule = Literal[tuple(policies.FUSION_RULES)]
    Scorer = Literal[tuple(policies.SCORERS)]
    ColdStoreKind = Literal[tuple(policies.COLD_STORES)]
    ColdCodec = Literal[tuple(policies.CODECS)]
SummaryBias = Literal["log_size", "none"]
IndexDtype = Literal["model", "float16", "int8"]
FusionRope = Literal["rerotate", "raw"]
PositionMode = Literal["real", "window"]
SelectionPool = Literal["mean", "max"]
ColdLowRank = Literal["none", "keys", "values", "kv"]
RerankCodec = Literal["exact", "int4", "int2", "sign"]
RerankMirror = Literal["none", "bf16", "int8"]
DecodeStep = Literal["eager", "static", "graph"]
# Bits per key element of each re-rank code (compress/key_code.py); each channel of a block
# also keeps an fp16 scale and zero (RERANK_CODE_BLOCK_BYTES per channel and block).
RERANK_CODE_BITS = {"int4": 4, "int2": 2, "sign": 1}
RERANK_CODE_BLOCK_BYTES = 4
# `prefetch_threads: auto` (the default) is settled when a cache is made for a model on a device
# (`FlashMemoryConfig.prefetch_threads_on`): none for a model on a CPU with a disk tier of exact
# blocks (flashmem.recipe.HOST_DISK: its pages are read from the files), else this many.
AUTO_PREFETCH_THREADS = 2


def rerank_key_bytes(codec: str, dtype_bytes: float, block_tokens: int) -> float:
    """Bytes one key element costs the re-rank to read: the model's dtype when exact, else
    the code's bits plus its per-block scale and zero spread over the block's tokens."""
    if codec == "exact":
        return float(dtype_bytes)
    return RERANK_CODE_BITS[codec] / 8 + RERANK_CODE_BLOCK_BYTES / max(1, block_tokens)


ColdKeyBasis = Literal["attention", "pca"]
# lsa_layer_shares are relative weights (a layer profile gives 0.1-3): past this they only
# overflow the split's arithmetic
MAX_LAYER_SHARE = 1e6


# The budget solver (flashmem.sizing.budget.for_budget) registers itself here when it is
# imported (flashmem/__init__.py imports it): the config does not import the solver, which
# builds configs, so there is no import circle.
_budget_solver: Callable[..., FlashMemoryConfig] | None = None


def set_budget_solver(solver: Callable[..., FlashMemoryConfig]) -> None:
    """Register what `FlashMemoryConfig.for_budget` calls (flashmem.sizing.budget does)."""
    global _budget_solver
    _budget_solver = solver


class FlashMemoryConfig(BaseModel):
    """Configuration of one FlashMemory cache (all layers share it)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # --- resident, exact ---------------------------------------------------
    sink_tokens: int = Field(4, ge=0, description="first tokens kept exact and always attended")
    gpu_cache_limit: int = Field(32768, ge=1, description="recent window W: last tokens kept exact on the device")
    # --- sealed history -------------------------------------------------------
    hca_chunk_size: int = Field(128, ge=1, description="block size B: history unit; one HCA entry per block")
    csa_chunk_size: int = Field(4, ge=1, description="tokens fused into one CSA entry")
    csa_band_tokens: int = Field(1024, ge=0, description="history behind the window kept resident as CSA entries")
    fusion_rule: FusionRule = Field(
        "attention_mass", description="how CSA/HCA fusion weights are computed from the data"
    )
    fusion_rope: FusionRope = Field(
        "rerotate", description="un-rotate keys before pooling and re-rotate at the chunk centre"
    )
    use_summaries: bool = Field(True, description="attend CSA/HCA entries of unselected blocks (false: selection only)")
    position_mode: PositionMode = Field(
        "real",
        description="positions attention sees: real (every token at its own) or window (InfLLM-style: sinks, "
        "selected blocks, open block, window and new tokens at consecutive positions from 0, so inputs "
        "beyond the model's training length stay inside it; needs use_summaries: false)",
    )
    summary_bias: SummaryBias = Field(
        "none", description="logit bias of a fused entry: log(tokens it stands for) or none"
    )
    # --- index and selection ----------------------------------------------------
    lsa_scorer: Scorer = Field("quest", description="block scorer of the index")
    lsa_keep_ratio: float = Field(0.135, gt=0.0, le=1.0, description="fraction of sealed blocks selected per step")
    lsa_top_k: int | None = Field(None, ge=0, description="selected blocks per step; overrides lsa_keep_ratio when set")
    lsa_min_blocks: int = Field(1, ge=0, description="at least this many blocks are selected when any are sealed")
    lsa_layer_shares: dict[int, float] | Literal["profile"] | None = Field(
        None,
        description="pages per layer relative to lsa_top_k ({layer: share}, layers not named: 1): the "
        "managed layers split their lsa_top_k x layers pages by share, so the total stays the same; "
        "profile: the shares from the model's layer profile (how far each layer attends), read or "
        "measured at attach; null: every layer selects lsa_top_k",
    )
    lsa_layer_profile_weight: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="with lsa_layer_shares: profile, how far the split moves from even (0) to the profile's (1)",
    )
    lsa_page_tokens: int | None = Field(
        None,
        ge=1,
        description="scoring and selection unit in tokens (divides hca_chunk_size); null: the block. "
        "lsa_top_k / lsa_keep_ratio then count pages",
    )
    lsa_follow_pages: int = Field(
        0,
        ge=0,
        le=8,
        description="a selected page brings the next N pages within the same lsa_top_k: "
        "the text after a match (an answer after its cue) comes with it",
    )
    rest_entry: bool = Field(
        False,
        description="without summaries, one entry per KV head stands for every sealed token "
        "not attended exactly (logit from the index, mean value), so attention keeps their mass",
    )
    lsa_pool: SelectionPool = Field(
        "mean",
        description="how a GQA group and a chunk's queries pool their page distributions: "
        "mean (expected mass) or max (a page any query head wants strongly wins)",
    )
    lsa_rerank: int = Field(
        1,
        ge=1,
        le=16,
        description="the index picks this many times lsa_top_k candidate pages; their exact keys, "
        "read from the cold tier each step, keep the lsa_top_k with the most attention mass (1: off)",
    )
    lsa_rerank_min_pages: int = Field(
        0,
        ge=0,
        description="with lsa_rerank > 1, at least this many candidate pages per layer and step (all of "
        "them below it): a layer with few pages still has its selection checked against exact keys, "
        "while the reads per step stay bounded at long inputs",
    )
    lsa_rerank_max_tokens: int | None = Field(
        None,
        ge=1,
        description="re-rank (lsa_rerank) only while at most this many tokens are sealed; past it the "
        "index's choice stands, and no candidate keys are read (null: always re-rank). On an accelerator "
        "the candidates' keys bound decode throughput at long contexts (docs/accelerator.md)",
    )
    lsa_rerank_codec: RerankCodec = Field(
        "exact",
        description="what the re-rank (lsa_rerank) scores candidates by: exact (their keys as the cold "
        "tier holds them) or a code of each sealed block's keys kept beside the cold tier: int4, int2 "
        "or sign (1 bit), each channel with a scale and zero per block (KIVI's per-channel keys). The "
        "re-rank then reads bits/16 of a bf16 key (docs/accelerator.md)",
    )
    lsa_rerank_mirror: RerankMirror = Field(
        "none",
        description="with lsa_rerank and lsa_rerank_codec exact: a copy of every sealed key in host "
        "memory, filled as blocks seal, that the re-rank scores in place when it ranks on the host: "
        "bf16 (half the bytes of fp32 keys) or int8 (a scale per token and KV head); none: the cold "
        "tier's keys as they lie (cache/rerank_codes.py KeyMirror)",
    )
    lsa_cache_pages: int = Field(
        0,
        ge=0,
        le=2**20,
        description="pages per layer and KV head the device keeps past this step's selection: the "
        "most recently selected ones that left it. A page that comes back is not read over the link "
        'again (counted in the budget, held as the working set is; docs/accelerator.md, "A page '
        'cache past the selection")',
    )
    lsa_rerank_on_device: bool = Field(
        False,
        description="with a lsa_rerank_codec code: this step's candidates' codes are held on the device "
        "(counted in the budget, as the index is) and scored there; only the codes of candidates the "
        "last step did not hold cross the link. Off: the codes are scored on the host, where they lie "
        "(its compute bounds a GPU's decode throughput at long contexts, docs/accelerator.md)",
    )
    lsa_open_room: bool = Field(
        False,
        description="the working set borrows the open block's unused room: while it holds n of its B - 1 "
        "tokens, a step selects as many more pages as (B - 1 - n) tokens' bytes buy, so the device holds "
        "the budget on every step (the solver sizes for the open block full) and uses it on every step",
    )
    lsa_select_every: int = Field(
        1,
        ge=1,
        le=64,
        description="decode steps a selection serves: the index ranks and the working set gathers on "
        "one step in N; the N - 1 after it attend the same pages (and the tokens since, exactly, in "
        "the window). A block sealed since, or a forward of several tokens, selects again. On an "
        "accelerator the ranking is most of a step's operators (docs/accelerator.md); 1: every step",
    )
    select_per_token_max: int = Field(
        64,
        ge=0,
        le=4096,
        description="after the prompt (the first one-token forward or crop), a forward of at most this many "
        "tokens that attends its selection (speculative decoding's verify forward, prompt lookup's, a "
        "short follow-up turn) runs its attention one token at a time, each token with the selection a "
        "one-token step makes, so assisted generation gives the tokens plain decoding gives; a longer "
        "one, or a prompt chunk, selects once for all its tokens (their pooled mass); 0: every such "
        "forward selects once",
    )
    decode_step: DecodeStep = Field(
        "eager",
        description="how a decode step runs: eager (any config) or static: the steps between two seals "
        "with fixed shapes and no host reads (cache/static_step.py), the form a CUDA graph can replay. "
        "static needs position_mode real, no summaries or rest entry, lsa_rerank 1 or a re-rank by codes "
        "held on the device (lsa_rerank_codec int4/int2/sign, lsa_rerank_on_device), lsa_select_every 1, "
        "lsa_cache_pages 0, lsa_feedback_share 0 and exact blocks in cold_store memory; it does not take "
        "lsa_open_room's extra pages (a segment holds its slots to its end). graph: static, each layer's "
        "step captured in a CUDA graph once per segment and replayed (cache/step_graph.py; on CUDA where "
        "the device reads the cold tier itself, store/mapped.py; elsewhere it runs as static)",
    )
    lsa_fetch_share: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="with decode_step static: at most this share of a step's selected pages (rounded up) "
        "enters the working set per KV head a step, read in one gather of that fixed size; a new page past "
        "it waits for the next step, and the step attends what it holds. The re-rank's candidates' codes "
        "likewise, as many a step as pages (a new candidate past it is not one until read). null: every "
        "selected page and candidate is read each step (the eager step's selection exactly, at k pages of "
        "reads)",
    )
    lsa_feedback_share: float = Field(
        0.0,
        ge=0.0,
        le=0.5,
        description="a second hop: this share of each step's selected pages goes to the pages whose mean "
        "values look most like the best selected ones (pseudo-relevance feedback: notes that repeat a "
        "pattern bring each other), in place of the lowest-ranked picks; 0: off",
    )
    lsa_feedback_seeds: int = Field(
        2, ge=1, le=64, description="with lsa_feedback_share: the selected pages the second hop starts from"
    )
    prefill_exact_tokens: int = Field(
        0,
        ge=0,
        description="while the context is at most this many tokens, the prompt (every forward of "
        "more than one token before the first one-token forward) attends every earlier token "
        "exactly, as the full cache does, and selection starts at the first one-token forward; with "
        "an exact cold tier the earlier tokens are read back from the tiers chunk by chunk (nothing "
        "more is held), with a lossy one the prompt's K/V is held on the device until then (the "
        "prefill_kv tier, counted in the peak); 0: the prompt attends its selection too",
    )
    exact_on_doubt: float = Field(
        0.0,
        ge=0.0,
        le=20.0,
        description="a one-token decode forward whose top two next-token logits are closer than this "
        "(nats) in any row is undone and run again with every managed layer attending every earlier "
        "token exactly, read back from the tiers as an exact prompt is (cache/doubt.py): near ties "
        "decided as the full cache decides them, at the price of reading the cold tier on those steps "
        "(counted in traffic_report and memory_report's doubt counts); needs an exact cold tier; 0.5 in "
        "the recipe for a model on a CPU with a memory cold tier (recipe.HOST_DOUBT); 0: off",
    )
    exact_on_doubt_share: float = Field(
        0.125,
        gt=0.0,
        le=1.0,
        description="exact_on_doubt redoes at most this share of the one-token forwards it checks, "
        "past its first 8 (cache/doubt.py FREE_REDOS): after n checked steps at most "
        "8 + share x n have been redone, so a model whose every step is a near tie (random weights, "
        "sampling at high temperature) pays a bounded cost; near ties past it are kept as "
        "selected and counted (memory_report's doubt_capped); 1: every near tie is redone",
    )
    exact_on_doubt_min_mass: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="exact_on_doubt redoes a near tie only where its two tokens hold at least this much "
        "probability together (in the row whose gap is below the threshold); a flatter next-token "
        "distribution (random weights, a word among many) stays as selected and is counted "
        "(memory_report's doubt_flat); 0: every near tie",
    )
    lsa_prefill_queries: int = Field(
        0,
        ge=0,
        description="queries of a longer prefill chunk that score the index for its selection (evenly "
        "spaced, the last included; 0: all): the index work per chunk stays fixed (long inputs), "
        "and with lsa_rerank the sample is re-ranked",
    )
    lsa_share_heads: bool = Field(
        False,
        description="the KV heads of a layer select the same pages (their expected masses summed, "
        "as InfLLM does): a step reads up to kv_heads times fewer cold blocks",
    )
    lsa_index_dtype: IndexDtype = Field(
        "model", description="precision of resident index vectors: model dtype, float16 or int8"
    )
    calibration: str | None = Field(
        None, description="folder written by `flashmem calibrate` (lowrank and learned scorers)"
    )
    # --- cold tier and prefetch ---------------------------------------------------
    cold_store: ColdStoreKind = Field("memory", description="where exact K/V of sealed blocks live")
    cold_dir: str | None = Field(None, description="folder of the disk cold tier (cold stores with files only)")
    cold_codec: ColdCodec = Field("exact", description="coding of K/V in the cold tier")
    working_set_codec: Literal["model", "int8"] = Field(
        "model",
        description="the selected pages' K/V on the device: model (its dtype) or int8 (per token "
        "row with an fp32 scale, decoded for each step's attention; a budget then holds about 2x "
        "(bf16) or 4x (fp32) the pages)",
    )
    cold_ram_bytes: int = Field(256 * 2**20, ge=0, description="layered store: RAM LRU of blocks in front of the disk")
    prefetch_window: int = Field(16384, ge=0, description="tokens around selected blocks that may be prefetched")
    prefetch_threads: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        "auto",
        description="background loader threads (0: off); auto: none for a model on a CPU with a disk "
        "cold tier of exact blocks (a step reads its pages from the files), else 2",
    )
    persist: bool = Field(False, description="keep the disk cold tier after the cache closes")
    # A disk or LMDB cold tier writes behind: sealed blocks wait in RAM until written. On a CPU,
    # where the disk tier is what takes the cold K/V out of RAM, this is what bounds the process's
    # RAM beyond the budget (a long prompt seals faster than the disk writes).
    cold_pending_mb: int = Field(
        256, ge=1, le=1 << 20, description="MiB of sealed blocks a disk/LMDB cold tier holds before puts wait"
    )
    # glibc's heap keeps freed blocks once its threshold rises, so a CPU's RSS peaks at several
    # times the budget with a disk tier (cache/host_heap.py); fixing the threshold is
    # process-wide, hence the user's choice (32 MiB: the most glibc takes on 64-bit)
    host_mmap_threshold: int | None = Field(
        None,
        ge=4096,
        le=32 << 20,
        description="bytes: fix glibc's mmap threshold for the whole process when the cache is made "
        "(blocks this large go back to the OS when freed); None leaves glibc's own",
    )
    # --- layers and projections -------------------------------------------------
    keep_full_layers: list[int] = Field(
        default_factory=list, description="layers with a plain full cache; negatives from the end"
    )
    low_rank_dim: int | None = Field(
        None,
        ge=1,
        description="MLA-style latent dim r: the lowrank/learned scorers' rank and the cold tier's "
        "with cold_low_rank (default for the scorers: the calibration's rank)",
    )
    cold_low_rank: ColdLowRank = Field(
        "none",
        description="keep sealed blocks' keys (pre-RoPE), values or both in the cold tier as "
        "low_rank_dim coefficients on the calibration's bases, reconstructed on every read "
        "(keys re-rotated at their positions); none: exact (or cold_codec-coded) K/V",
    )
    cold_key_basis: ColdKeyBasis = Field(
        "attention",
        description="cold_low_rank keys' code: attention (the rank-r code with the least expected "
        "q.k error over the calibration's queries) or pca (the keys' own principal directions)",
    )
    # --- execution ------------------------------------------------------------------
    prefill_chunk: int = Field(512, ge=1, description="prompt tokens per prefill chunk (bounds peak memory)")
    prefill_split_tail: bool = Field(
        True,
        description="the prompt's last 32 queries, then its last query, select on their own "
        "(false: plain prefill_chunk chunks)",
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> FlashMemoryConfig:
        problems = self.combination_problems()
        if problems:
            raise ValueError(problems[0] + _more(problems[1:]))
        return self

    def combination_problems(self) -> list[str]:
        """Every combination of keys that is not allowed, one line each ([] when none)."""
        out = [*self._block_problems(), *self._cold_store_problems(), *self._position_problems()]
        if self.cold_low_rank != "none" and self.low_rank_dim is None:
            out.append(
                f"cold_low_rank: {self.cold_low_rank!r} needs low_rank_dim (coefficients kept per token "
                "and KV head); allowed: low_rank_dim: 1..head_dim (e.g. 32 of 64), or cold_low_rank: none"
            )
        if self.lsa_rerank_on_device and self.lsa_rerank_codec == "exact":
            out.append(
                "lsa_rerank_on_device: true holds the candidates' codes on the device, but lsa_rerank_codec "
                "is 'exact'; allowed: lsa_rerank_codec int4, int2 or sign with it, or lsa_rerank_on_device: false"
            )
        if self.lsa_rerank_mirror != "none" and self.lsa_rerank_codec != "exact":
            out.append(
                f"lsa_rerank_mirror: {self.lsa_rerank_mirror!r} and lsa_rerank_codec: {self.lsa_rerank_codec!r} "
                "both give the re-rank's keys; allowed: lsa_rerank_mirror: none with a code, or lsa_rerank_codec: exact"
            )
        return out + self._layer_problems() + self._static_step_problems()

    def _static_step_problems(self) -> list[str]:
        """decode_step: static with a feature its fixed-shape step does not have."""
        if self.decode_step == "eager":
            return (
                []
                if self.lsa_fetch_share is None
                else [
                    "lsa_fetch_share: set, but decode_step is 'eager' (it reads every new page); "
                    "allowed: lsa_fetch_share with decode_step: static or graph, or lsa_fetch_share: null"
                ]
            )
        needs = {
            "position_mode": (self.position_mode, "real"),
            "use_summaries": (self.use_summaries, False),
            "rest_entry": (self.rest_entry, False),
            "lsa_select_every": (self.lsa_select_every, 1),
            "lsa_cache_pages": (self.lsa_cache_pages, 0),
            "lsa_feedback_share": (self.lsa_feedback_share, 0.0),
            "cold_store": (self.cold_store, "memory"),
            "cold_codec": (self.cold_codec, "exact"),
            "cold_low_rank": (self.cold_low_rank, "none"),
        }
        out = [
            f"decode_step: {self.decode_step} does not support {key}: {got!r}; allowed: {key}: {want!r} "
            "with it, or decode_step: eager"
            for key, (got, want) in needs.items()
            if got != want
        ]
        if self.lsa_rerank > 1 and (self.lsa_rerank_codec == "exact" or not self.lsa_rerank_on_device):
            out.append(
                f"decode_step: {self.decode_step} re-ranks (lsa_rerank: {self.lsa_rerank}) by key codes held on the device "
                f"only, not lsa_rerank_codec {self.lsa_rerank_codec!r} with lsa_rerank_on_device "
                f"{self.lsa_rerank_on_device}; allowed: lsa_rerank_codec int4, int2 or sign with "
                "lsa_rerank_on_device: true, or lsa_rerank: 1, or decode_step: eager"
            )
        return out

    def _block_problems(self) -> list[str]:
        """Block, page and scorer sizes that do not fit together."""
        out: list[str] = []
        if self.hca_chunk_size % self.csa_chunk_size:
            out.append(
                f"hca_chunk_size: {self.hca_chunk_size} is not a multiple of csa_chunk_size "
                f"({self.csa_chunk_size}); allowed: a multiple such as "
                f"{self.csa_chunk_size * max(1, round(self.hca_chunk_size / self.csa_chunk_size))}"
            )
        page = self.page_tokens  # the block unless set: then the check above says it
        if self.lsa_page_tokens is not None and (self.hca_chunk_size % page or page % self.csa_chunk_size):
            out.append(
                f"lsa_page_tokens: {page} must divide hca_chunk_size ({self.hca_chunk_size}) and be a "
                f"multiple of csa_chunk_size ({self.csa_chunk_size}); allowed: e.g. 16 with 64-token blocks"
            )
        if page != self.hca_chunk_size and not policies.SCORERS[self.lsa_scorer].scores_pages:
            out.append(
                f"lsa_page_tokens: {self.lsa_scorer!r} ranks blocks by their HCA entry and cannot score "
                f"pages; allowed: null (or {self.hca_chunk_size}) with it, or another lsa_scorer"
            )
        return out

    def _cold_store_problems(self) -> list[str]:
        """cold_dir and persist set against a cold_store that does (not) keep files."""
        out: list[str] = []
        store = policies.COLD_STORES[self.cold_store]
        with_files = ", ".join(repr(n) for n, p in policies.COLD_STORES.items() if p.needs_dir)
        if store.needs_dir and not self.cold_dir:
            out.append(f"cold_dir: required when cold_store is {self.cold_store!r}; allowed: a writable folder path")
        if self.cold_dir is not None and not store.needs_dir:
            out.append(
                f"cold_dir: {self.cold_dir[:80]!r} is given, but cold_store {self.cold_store!r} keeps no files; "
                f"allowed: cold_dir with cold_store {with_files}, or no cold_dir"
            )
        if self.cold_dir is not None and "\x00" in self.cold_dir:
            out.append("cold_dir: the path contains a NUL byte; allowed: a folder path without NUL bytes")
        if self.persist and not store.needs_dir:
            out.append(
                f"persist: true keeps the cold tier's files, but cold_store {self.cold_store!r} has none; "
                f"allowed: persist with cold_store {with_files} (and cold_dir), or persist: false"
            )
        return out

    def _position_problems(self) -> list[str]:
        """What position_mode: window cannot place."""
        out: list[str] = []
        if self.position_mode == "window" and self.use_summaries:
            out.append(
                "position_mode: window places selected blocks only (summaries have no place yet); "
                "allowed: window with use_summaries: false, or position_mode: real"
            )
        if self.exact_on_doubt and (self.cold_codec != "exact" or self.cold_low_rank != "none"):
            out.append(
                f"exact_on_doubt: {self.exact_on_doubt} reads every earlier token back exactly, but the cold "
                f"tier keeps them lossy (cold_codec: {self.cold_codec}, cold_low_rank: {self.cold_low_rank}); "
                "allowed: exact_on_doubt with cold_codec: exact and cold_low_rank: none, or exact_on_doubt: 0"
            )
        if self.position_mode == "window" and self.prefill_exact_tokens:
            out.append(
                "position_mode: window keeps positions inside the trained range, but an exact prefill "
                "attends every token at its real position; allowed: prefill_exact_tokens: 0 with "
                "window, or position_mode: real"
            )
        if self.position_mode == "window" and self.exact_on_doubt:
            out.append(
                "position_mode: window keeps positions inside the trained range, but exact_on_doubt's "
                "exact steps attend every token at its real position; allowed: exact_on_doubt: 0 with "
                "window, or position_mode: real"
            )
        return out

    def _layer_problems(self) -> list[str]:
        """Per-layer shares and full layers that are not allowed."""
        out: list[str] = []
        if isinstance(self.lsa_layer_shares, dict):
            bad = {i: v for i, v in self.lsa_layer_shares.items() if i < 0 or not 0 <= v <= MAX_LAYER_SHARE}
            if bad:
                i, v = next(iter(bad.items()))
                out.append(
                    f"lsa_layer_shares: {{{i}: {v}}}; allowed: layer indices >= 0 mapped to finite shares >= 0 "
                    f"and <= {MAX_LAYER_SHARE:g}"
                )
            if self.lsa_top_k is None:
                out.append(
                    "lsa_layer_shares splits lsa_top_k pages over the layers; allowed: set lsa_top_k, "
                    "or lsa_layer_shares: null"
                )
        if len(set(self.keep_full_layers)) != len(self.keep_full_layers):
            out.append(f"keep_full_layers: {self.keep_full_layers} repeats a layer; allowed: distinct layers")
        return out

    # ------------------------------------------------------------------ loading
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            if getattr(_RAW, "on", False):  # `problems` wants pydantic's whole report
                raise
            problems = type(self).problems(data) or [_one_line(exc, data)]
            raise ConfigError(problems[0] + _more(problems[1:])) from None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[str]:
        """Every problem of a mapping of keys, one line each; [] when it is a valid config.

        Each bad key is named (unknown, wrong type, out of range), then the
        combinations the remaining keys break (`combination_problems`).
        """
        try:
            _validate_raw(cls, data)
            return []
        except ValidationError as exc:
            errors = [e for e in exc.errors() if e.get("loc")]  # bad keys (no loc: a combination)
        found = _problems(errors, data)
        bad_keys = {str(e["loc"][0]) for e in errors}
        good = {k: v for k, v in data.items() if k not in bad_keys}
        try:
            _validate_raw(cls, good)
        except ValidationError as exc:
            if any(e.get("loc") for e in exc.errors()):  # not expected: the bad keys are out
                return found or _problems(exc.errors(), good)
            found += cls.model_construct(**good).combination_problems()
        return found

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> FlashMemoryConfig:
        """Build from a mapping; accepts the seed's `flash_memory:` wrapper."""
        keys = _unwrap(data, source)
        try:
            return cls(**keys)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def problems_in_yaml(cls, path: str | Path) -> list[str]:
        """Every problem of a YAML config file, one line each naming the file ([] when it
        loads): what `flashmem config check` prints."""
        from flashmem.user_files import MiB, read_user_text

        try:
            text = read_user_text(Path(path), "config", MiB, ConfigError)
            data = _unwrap(_parse_yaml(text, str(path)), str(path))
        except ConfigError as exc:
            return [str(exc)]
        return [f"{path}: {p}" for p in cls.problems(data)]

    @classmethod
    def from_yaml(cls, path: str | Path) -> FlashMemoryConfig:
        """Load a YAML file; errors name the file and the key."""
        from flashmem.user_files import MiB, read_user_text

        path = Path(path)
        # a regular file of at most 1 MiB: /dev/zero or a FIFO must not hang or fill memory
        text = read_user_text(path, "config", MiB, ConfigError)
        return cls.from_yaml_text(text, source=str(path))

    @classmethod
    def from_yaml_text(cls, text: str, source: str = "config") -> FlashMemoryConfig:
        return cls.from_dict(_parse_yaml(text, source), source=source)

    @classmethod
    def for_budget(
        cls,
        budget: float,
        tokens: int,
        model: Any = None,
        *,
        variant: str = "default",
        group: int | None = None,
        head_dim: int | None = None,
        dtype_bytes: int | None = None,
        **overrides: Any,
    ) -> FlashMemoryConfig:
        """The recipe (`flashmem.recipe`) at `budget` x the full cache's device-resident
        KV bytes after `tokens` tokens (0 < budget <= 1; 1 <= tokens <= 2**27): 16-token
        pages scored by their mean key (int8), 64-token blocks, the selected pages held as
        int8 on the device, the split of window / selected pages searched to fit. The
        selected pages stop at 4,096 tokens per layer (`flashmem.recipe.SELECTED_TOKENS_CAP`):
        a step attends a bounded number of tokens, so at long prompts (from about 12K
        tokens at 1/8) the config holds less than `budget`.

        model: a transformers model (or its config), or a model the calculator knows
        (`'llama-3.1-8b'`, `'smollm2'`, an HF folder, a .gguf file: see `flashmem estimate
        --help`), to read the GQA group, head dim and dtype from (a name: fp32 for the
        models `flashmem.load_model` loads, else the calculator's dtype); without it give
        group / head_dim / dtype_bytes (defaults 1 / 64 / 4); given ones win.
        variant: 'default' (the recipe) or an experiment variant of the evaluation package
        (`flashmem_eval.variants`); overrides: config keys laid over it. See
        flashmem.sizing.budget.budget_config and docs/measurements.md. Bad arguments raise
        a one-line FlashMemError.

        The recipe splits its pages over the layers by how far each attends
        (`lsa_layer_shares: profile`): `attach` reads the model's layer profile from the
        cache or measures it there once (`flashmem.calibration.layer_profile`).
        """
        if _budget_solver is None:  # cannot happen: importing flashmem imports the solver
            raise FlashMemError("for_budget: no budget solver registered; allowed: import flashmem first")
        given = {"group": group, "head_dim": head_dim, "dtype_bytes": dtype_bytes}
        return _budget_solver(budget, tokens, model, variant, given, **overrides)

    def to_yaml(self) -> str:
        return yaml.safe_dump({"flash_memory": self.model_dump()}, sort_keys=False)

    # ------------------------------------------------------------------ binding
    def resolve_full_layers(self, num_layers: int) -> frozenset[int]:
        """`keep_full_layers` as non-negative layer indices of a model with `num_layers`."""
        out = set()
        for idx in self.keep_full_layers:
            if not -num_layers <= idx < num_layers:
                raise ConfigError(
                    f"keep_full_layers: layer {idx} is outside the model's {num_layers} layers; "
                    f"allowed: {-num_layers}..{num_layers - 1}"
                )
            out.add(idx % num_layers)
        return frozenset(out)

    def check_for_model(self, num_layers: int) -> None:
        """Validate the parts of the config that depend on the model."""
        self.resolve_full_layers(num_layers)

    @property
    def csa_per_block(self) -> int:
        return self.hca_chunk_size // self.csa_chunk_size

    @property
    def csa_band_blocks(self) -> int:
        """Newest sealed blocks that keep their CSA entries resident (the near band)."""
        return self.csa_band_tokens // self.hca_chunk_size

    @property
    def keeps_hca_entries(self) -> bool:
        """HCA entries stay resident: attended as summaries, or read by the scorer.
        Without summaries (`use_summaries: false`) the CSA band, the HCA entries and the
        fusion rule's query buffer are not kept at all: their bytes go to selection."""
        return self.use_summaries or policies.SCORERS[self.lsa_scorer].reads_hca_entries

    @property
    def keeps_rest_entry(self) -> bool:
        """The rest entry is attended: asked for, and no HCA entries already stand for
        the left-out blocks."""
        return self.rest_entry and not self.use_summaries

    @property
    def page_tokens(self) -> int:
        """Tokens per scoring/selection unit (a page; the whole block unless set)."""
        return self.lsa_page_tokens or self.hca_chunk_size

    @property
    def pages_per_block(self) -> int:
        return self.hca_chunk_size // self.page_tokens

    def layer_top_k(self, managed: list[int]) -> dict[int, int]:
        """Pages each managed layer selects: lsa_top_k x len(managed) split by
        lsa_layer_shares (largest remainder, so the total is exact); {} without shares."""
        if not isinstance(self.lsa_layer_shares, dict) or self.lsa_top_k is None or not managed:
            return {}
        w = {i: self.lsa_layer_shares.get(i, 1.0) for i in managed}
        total, s = self.lsa_top_k * len(managed), sum(w.values())
        if s <= 0:
            return {}
        exact = {i: total * v / s for i, v in w.items()}
        k = {i: int(x) for i, x in exact.items()}
        for i in sorted(exact, key=lambda i: k[i] - exact[i])[: total - sum(k.values())]:
            k[i] += 1
        return k

    def prefetch_threads_on(self, device_type: str) -> int:
        """Loader threads for a cache whose model runs on `device_type` ("cpu", "cuda", ...): the
        number set, or for `auto` none on a CPU with a disk tier of exact blocks, whose loaders
        would hold whole blocks in the RAM the tier saves and read whole blocks where a step reads
        pages (flashmem.recipe.HOST_DISK), else AUTO_PREFETCH_THREADS."""
        if self.prefetch_threads != "auto":
            return self.prefetch_threads
        from flashmem.recipe import HOST_DISK

        on_cpu = device_type == "cpu" and self.reads_disk_pages()
        return int(HOST_DISK["prefetch_threads"]) if on_cpu else AUTO_PREFETCH_THREADS

    def reads_disk_pages(self) -> bool:
        """Whether the cold tier is files a step reads page by page (`DiskStore.gather_pages`):
        a disk tier of exact blocks, not low-rank."""
        return self.cold_store == "disk" and self.cold_codec == "exact" and self.cold_low_rank == "none"

    def blocks_to_select(self, num_sealed: int) -> int:
        """How many selection units (sealed blocks, or pages with `lsa_page_tokens`) the
        selection attends exactly this step, out of `num_sealed` such units."""
        if num_sealed <= 0:
            return 0
        if self.lsa_top_k is not None:
            k = self.lsa_top_k
        else:
            k = int(round(self.lsa_keep_ratio * num_sealed))
        return max(0, min(num_sealed, max(k, self.lsa_min_blocks)))


_RAW = threading.local()


def _validate_raw(cls: type[FlashMemoryConfig], data: dict[str, Any]) -> None:
    """Validate `data`, letting pydantic's ValidationError (every error) through."""
    before = getattr(_RAW, "on", False)
    _RAW.on = True
    try:
        cls(**data)
    finally:
        _RAW.on = before


def _parse_yaml(text: str, source: str) -> Any:
    """YAML text -> Python data, or a one-line ConfigError naming the source and line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    except Exception as exc:  # PyYAML's constructors raise e.g. IndexError on '!!int'
        raise ConfigError(f"{source}: not valid YAML: {type(exc).__name__} while reading a tagged value") from None


def _unwrap(data: Any, source: str) -> dict[str, Any]:
    """The keys of a config mapping (optionally under `flash_memory:`), or a ConfigError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: top level is {type(data).__name__}; allowed: a mapping (optionally under 'flash_memory:')"
        )
    if "flash_memory" in data:
        extra = sorted(str(k) for k in data if k != "flash_memory")
        if extra:
            raise ConfigError(f"{source}: unknown top-level key {extra[0]!r}; allowed: 'flash_memory'")
        data = data["flash_memory"] if data["flash_memory"] is not None else {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: flash_memory is {type(data).__name__}; allowed: a mapping of keys")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{source}: key {bad[0]!r} is not a name; allowed: {_allowed()}")
    return data


def _more(rest: list[str]) -> str:
    """' (and N more: key, ...)' naming the keys of the problems after the first."""
    if not rest:
        return ""
    keys = []
    for p in rest:
        key = p.split("'")[1] if p.startswith("unknown key '") else p.split(":", 1)[0]
        keys.append(key[:40])
    return f" (and {len(rest)} more: {', '.join(dict.fromkeys(keys))}; `flashmem config check` lists each)"


def _problems(errors: list[Any], data: dict[str, Any]) -> list[str]:
    """pydantic's errors as one line per bad key (its first error for that key)."""
    out, seen = [], set()
    for err in errors:
        loc = err.get("loc") or ()
        key = str(loc[0]) if loc else ""
        if key in seen:
            continue  # a union reports one error per member: the first names the key
        seen.add(key)
        out.append(_error_line(err, data))
    return out


def _allowed() -> str:
    return ", ".join(FlashMemoryConfig.model_fields)


def _one_line(exc: ValidationError, data: dict[str, Any]) -> str:
    """Turn pydantic's report into one line naming key, value and what is allowed."""
    return _error_line(exc.errors()[0], data)


def _error_line(err: Any, data: dict[str, Any]) -> str:
    """One pydantic error as one line naming key, value and what is allowed."""
    loc = err.get("loc") or ()
    key = str(loc[0]) if loc else ""
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        near = difflib.get_close_matches(key, FlashMemoryConfig.model_fields, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return f"unknown key {key!r}; {hint}allowed: {_allowed()}"
    if not key:  # a model_validator failure: its message already names the key
        msg = str(err.get("msg", ""))
        return msg.removeprefix("Value error, ")
    value = data.get(key, err.get("input"))
    field = FlashMemoryConfig.model_fields[key]
    return f"{key}: {value!r} is not allowed; allowed: {_describe(field, kind, err)}"


def _describe(field: Any, kind: str, err: Any) -> str:
    ann = field.annotation
    ctx = err.get("ctx") or {}
    bounds = []
    for m in field.metadata:
        for name, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, name, None)
            if v is not None:
                bounds.append(f"{sym} {v}")
    literal = getattr(ann, "__args__", None)
    if kind == "literal_error" and "expected" in ctx:
        return f"one of {ctx['expected']}"
    text = {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
    }.get(ann)
    if text is None:
        s = str(ann).replace("typing.", "")
        if s.startswith("list[int]"):
            text = "a list of integers (layer indices)"
        elif "dict[int, float]" in s:
            text = "profile, null, or a mapping {layer index: share}"
        elif "Literal['auto']" in s:
            text = "an integer 0 to 64, or 'auto'"
        elif "int" in s and "None" in s:
            text = "an integer or null"
        elif "str" in s and "None" in s:
            text = "a string or null"
        elif literal:
            text = "one of " + ", ".join(repr(a) for a in literal)
        else:
            text = s
    if bounds:
        text += " " + " and ".join(bounds)
    return text
