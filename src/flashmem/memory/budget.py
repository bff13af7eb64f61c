"""Budget -> config: the FlashMemory config whose device-resident KV bytes are
about a given fraction of the full cache's at a prompt length.

The budget is device-resident KV bytes / full-cache KV bytes over the managed
layers (docs/design.md, "Budget"). `budget_config` solves it with
`flashmem.memory.tiers.tier_counts`, so the predicted fraction at `tokens` is
as close to the budget as the grid allows; what a cache really holds is
measured from its tensors (`memory_report()["device_resident_bytes"]`).
`FlashMemoryConfig.for_budget` is the public entry point. Torch-free.
"""

from __future__ import annotations

from typing import Any

from flashmem.config import FlashMemoryConfig
from flashmem.errors import FlashMemError
from flashmem.memory.tiers import index_bytes, tier_counts, working_set_scale
from flashmem.models import geometry

# Recent query positions each managed layer keeps for the attention-mass fusion
# rule (flashmem.cache.flash_layer reads it from here).
RECENT_QUERY_TOKENS = 8

# Variants: config keys laid over the budget-mapped default.
# The default recipe is configs/cpu-small.yaml's: 64-token stored blocks,
# 16-token pages scored by their int8 mean key and re-ranked by their exact keys,
# 20 sink tokens, most of the budget on exact selected pages (docs/measurements.md,
# "Selection by pages").
RECIPE: dict[str, Any] = {
    "hca_chunk_size": 64,
    "lsa_scorer": "mean_key",
    "lsa_page_tokens": 16,
    "lsa_index_dtype": "int8",
    "summary_bias": "none",
    # No CSA/HCA summaries at these budgets: their bytes buy more selected pages,
    # which measured better on fidelity and as good on retrieval
    # (docs/measurements.md, "Summaries or more pages").
    "use_summaries": False,
    # 20 sink tokens, not StreamingLLM's 4: the index kept spending two of its few pages
    # on the text right after the 4 sinks (the prompt's opening), so they are kept as
    # sinks and the pages go to the history the query needs (docs/measurements.md,
    # "The rest entry, pooling, sinks").
    "sink_tokens": 20,
    # The index picks 4x the pages, their exact keys keep the best quarter (decode steps
    # and short chunks only): SmolLM2 KL at 1/8 and 1/16 about halved, more 2K needles
    # found (docs/measurements.md, "Re-ranking candidates by their exact keys").
    "lsa_rerank": 4,
    # ... and at least 256 candidates (every page up to 4,096 tokens): the layers the profile
    # gives few pages re-ranked too few, and SmolLM2 at 1/16 lost needles the exact keys of
    # every page find (docs/measurements.md, "A floor under the re-rank candidates").
    "lsa_rerank_min_pages": 256,
    # Pages split over the layers by how far each attends (the model's layer profile, read
    # or measured at attach): SmolLM2 answers 8K passkeys an even split misses
    # (docs/measurements.md, "Pages per layer by how far it attends").
    "lsa_layer_shares": "profile",
    # The selected pages held on the device as int8 rows: the budget buys ~3.8x the pages
    # of an fp32 model (~1.9x at bf16); SmolLM2 KL at 1/8 and 1/16 down 2-8x, more needles
    # found (docs/measurements.md, "An int8 working set").
    "working_set_codec": "int8",
    # The prompt attended exactly, as the full cache does, up to 32K tokens of context; pages
    # are selected from the first generated token. A prompt attended by its selection lost
    # answers the full cache gives, with the needle's pages selected at the answer (Gemma3 at
    # 2K and 1/16): what was missing was the prompt's own attention. The device holds the
    # prompt's K/V until then (docs/measurements.md, "The prompt attended exactly").
    "prefill_exact_tokens": 32768,
}
# From this budget up a selected page brings the page after it (the answer after
# its cue, `lsa_follow_pages: 1`); below it the pairs halve too few distinct pages
# and fidelity drops (docs/measurements.md, "Following pages").
FOLLOW_FROM_BUDGET = 1 / 8
VARIANTS: dict[str, dict[str, Any]] = {
    "default": dict(RECIPE),
    "quest": {**RECIPE, "lsa_scorer": "quest"},
    "gaussian": {**RECIPE, "lsa_scorer": "gaussian"},
    "raw": {**RECIPE, "fusion_rope": "raw"},
    "logbias": {**RECIPE, "summary_bias": "log_size"},
    "keynorm": {**RECIPE, "fusion_rule": "key_norm"},
    "summaries": {**RECIPE, "use_summaries": True},
    "nofollow": {**RECIPE, "lsa_follow_pages": 0},
    "follow": {**RECIPE, "lsa_follow_pages": 1},
    "max": {**RECIPE, "lsa_pool": "max"},
    "b32": {**RECIPE, "hca_chunk_size": 32},
    "rest": {**RECIPE, "rest_entry": True},
    "sink4": {**RECIPE, "sink_tokens": 4},
    "shared": {**RECIPE, "lsa_share_heads": True},
    "norerank": {**RECIPE, "lsa_rerank": 1},
    "rerank2": {**RECIPE, "lsa_rerank": 2},
    "rerank8": {**RECIPE, "lsa_rerank": 8},
    "rerank16": {**RECIPE, "lsa_rerank": 16},
    # the candidate floor: rrmin0 is the recipe before it, rrmin256 names the recipe in its runs
    "rrmin0": {**RECIPE, "lsa_rerank_min_pages": 0},
    "rrmin256": {**RECIPE, "lsa_rerank_min_pages": 256},
    # the working set in the model's dtype (the recipe until "An int8 working set");
    # wsint8 names the recipe in that section's runs
    "wsmodel": {**RECIPE, "working_set_codec": "model"},
    "wsint8": {**RECIPE, "working_set_codec": "int8"},
    "restfollow": {**RECIPE, "rest_entry": True, "lsa_follow_pages": 1},
    "int8": {**RECIPE, "cold_codec": "int8"},
    "int4": {**RECIPE, "cold_codec": "int4"},
    "b128": {**RECIPE, "hca_chunk_size": 128},
    "block": {**RECIPE, "lsa_page_tokens": None, "lsa_index_dtype": "model", "use_summaries": True},
    "lowrank": {**RECIPE, "lsa_scorer": "lowrank"},
    "learned": {**RECIPE, "lsa_scorer": "learned"},
    # a long prefill chunk's selection from 64 of its queries, re-ranked: better SmolLM2 KL at
    # 8K, 3 of 56 needles lost on Gemma3 (docs/measurements.md, "Prefill: a chunk's selection")
    "pq64": {**RECIPE, "lsa_prefill_queries": 64},
    # the prompt attended by its selection (the recipe before "The prompt attended exactly");
    # exact names the recipe in that section's runs
    "selprompt": {**RECIPE, "prefill_exact_tokens": 0},
    "exact": {**RECIPE, "prefill_exact_tokens": 32768},
    # every layer selects lsa_top_k pages
    "even": {**RECIPE, "lsa_layer_shares": None},
    # halfway between the even split and the profile's
    "half": {**RECIPE, "lsa_layer_profile_weight": 0.5},
}
# Target shares of the resident budget: window, selected blocks, CSA band.
SHAPE = (0.08, 0.7, 0.0)
# Variants that change the split rather than config keys.
SHAPES: dict[str, tuple[float, float, float]] = {"balanced": (0.4, 0.4, 0.0), "windowed": (0.6, 0.25, 0.0)}
VARIANTS.update({name: dict(RECIPE) for name in SHAPES})
# Selected pages a step attends, at most this many tokens per layer (on average over the
# layers), whatever the budget buys: past it a budget is a ceiling, not a target. At 1/8 the
# int8 working set buys a third of the context, 24K tokens per head at 64K, and decoding them
# every step made the recipe no faster than DynamicCache there (0.96x; 3.49x with the cap, one
# run). 4,096 is twice the 2,048 of ShadowKV and DeepSeek-V3.2's indexer and 1.5x what answered
# every Gemma3 prompt at 16K and 1/16. It binds from about 12K tokens at 1/8 and 25K at 1/16
# (docs/measurements.md, "A cap on the selected pages").
SELECTED_TOKENS_CAP = 4096
# Variants with another cap (None: none, the recipe before the cap).
CAPS: dict[str, int | None] = {"nocap": None, "cap8k": 8192}
VARIANTS.update({name: dict(RECIPE) for name in CAPS})
# The cold tier in the calibrated low-rank space (`cold_low_rank`; needs the model's
# calibration, `flashmem calibrate`): lr<parts><rank>, parts kv / k (keys) / v (values);
# -i8 / -i4: the stored coefficients int8 / int4-coded too (docs/measurements.md, "Low-rank cold tier").
VARIANTS.update(
    {
        f"lr{tag}{r}": {**RECIPE, "cold_low_rank": mode, "low_rank_dim": r}
        for tag, mode in (("kv", "kv"), ("k", "keys"), ("v", "values"))
        for r in (16, 32, 48)
    }
)
VARIANTS.update(
    {
        f"lr{tag}{r}-i{codec[3:]}": {**RECIPE, "cold_low_rank": mode, "low_rank_dim": r, "cold_codec": codec}
        for tag, mode in (("kv", "kv"), ("k", "keys"))
        for r in (32, 48)
        for codec in ("int8", "int4")
    }
)
# The keys' plain PCA code instead of the attention-weighted one (`cold_key_basis: pca`).
_LOW_RANK_KEYS = [n for n in VARIANTS if n.startswith("lrk") and "-" not in n]
VARIANTS.update({f"{n}-pca": {**VARIANTS[n], "cold_key_basis": "pca"} for n in _LOW_RANK_KEYS})


def predicted_ratio(
    cfg: FlashMemoryConfig, tokens: int, group: int = 1, head_dim: int = 64, dtype_bytes: int = 4
) -> float:
    """Resident token-equivalents / tokens, per managed layer and KV head.

    K+V entries count 1; the index counts its declared bytes over the bytes of
    one token's K+V (2 * head_dim * dtype_bytes); the cache also keeps the last
    RECENT_QUERY_TOKENS queries of each of the `group` query heads per KV head
    (for the fusion weights): 8 * group key-sized vectors.
    """
    c = tier_counts(cfg, tokens)
    qbuf = 0.5 * RECENT_QUERY_TOKENS * group if tokens > 0 and cfg.use_summaries else 0.0
    index = index_bytes(cfg, c, head_dim, dtype_bytes) / (2 * head_dim * dtype_bytes)
    # a coded working set (working_set_codec) counts its coded bytes
    ws_saved = c.working_set * (1 - working_set_scale(cfg, head_dim, dtype_bytes))
    return (c.resident_kv - ws_saved + index + qbuf) / max(1, tokens)


def budget_config(
    budget: float,
    tokens: int,
    variant: str = "default",
    group: int = 1,
    head_dim: int = 64,
    dtype_bytes: int = 4,
    **overrides: Any,
) -> FlashMemoryConfig:
    """A config whose predicted device-resident fraction at `tokens` is about `budget`.

    Searched: selected pages k (lsa_top_k), near band (multiple of the block
    size, only with summaries) and window W (multiple of 8). Among configs at
    most 3% over the target that come within 3% of the fullest such config
    (else the closest one) the one nearest the variant's split of the resident
    tokens (SHAPE, window 8% / selected pages 70% / CSA entries 0%, or SHAPES)
    is taken, so the selection from the cold tier is used whenever the budget
    allows a page.
    The selected pages are capped at SELECTED_TOKENS_CAP tokens (CAPS per variant):
    at long prompts the config holds less than the budget and each step attends
    a bounded number of tokens.
    Small budgets at short lengths can be unreachable (sinks + HCA entries +
    index + the open block already exceed them): the closest config is returned
    and the measured fraction says so.
    """
    if not 0 < budget <= 1:
        raise FlashMemError(f"budget: {budget!r} is not allowed; allowed: 0 < budget <= 1")
    keys = dict(VARIANTS.get(variant, {}))
    keys.setdefault("lsa_follow_pages", 1 if budget >= FOLLOW_FROM_BUDGET * (1 - 1e-6) else 0)
    if overrides.get("position_mode") == "window":
        keys["prefill_exact_tokens"] = 0  # an exact prompt attends at real positions
    keys.update(overrides)
    base = FlashMemoryConfig(**keys)
    B = base.hca_chunk_size
    step = 8
    target = budget * tokens
    cands = []
    # selected pages: every count to 64, then steps of 8 (long prompts at 1/8 select hundreds)
    per_page = base.page_tokens * working_set_scale(base, head_dim, dtype_bytes)
    ks = [*range(0, 65), *range(72, max(73, int(target / per_page) + 9), 8)]
    bands = range(0, 33) if base.use_summaries else [0]  # the band is dropped without summaries
    for k in ks:
        for band_blocks in bands:

            def make(w: int, k: int = k, band_blocks: int = band_blocks) -> FlashMemoryConfig:
                return base.model_copy(
                    update={
                        "gpu_cache_limit": w,
                        "csa_band_tokens": band_blocks * B,
                        "lsa_top_k": k,
                        "lsa_min_blocks": min(1, k),
                    }
                )

            lo, hi = 1, max(1, tokens // step)
            while lo < hi:  # smallest W (in steps) whose ratio reaches the budget
                mid = (lo + hi) // 2
                if predicted_ratio(make(mid * step), tokens, group, head_dim, dtype_bytes) >= budget:
                    hi = mid
                else:
                    lo = mid + 1
            for ws in {max(1, lo - 1), lo}:
                cfg = make(ws * step)
                r = predicted_ratio(cfg, tokens, group, head_dim, dtype_bytes)
                cands.append((abs(r - budget) / budget, cfg, r))
    # Never more than 3% over the budget; of those, the ones that use it fully
    # (within 3% of the fullest: a page is a coarse step at short prompts).
    under = [c for c in cands if c[2] <= 1.03 * budget]
    if under:
        fullest = max(c[2] for c in under)
        good = [c for c in under if c[2] >= fullest - 0.03 * budget]
    else:
        good = [min(cands, key=lambda c: c[0])]

    def shape(c: tuple[float, FlashMemoryConfig, float]) -> float:
        cfg = c[1]
        w = cfg.gpu_cache_limit / target
        sel = (cfg.lsa_top_k or 0) * per_page / target  # its share of the bytes
        csa = cfg.csa_band_tokens / cfg.csa_chunk_size / target
        sw, ss, sc = SHAPES.get(variant, SHAPE)
        return (w - sw) ** 2 + (sel - ss) ** 2 + (csa - sc) ** 2

    best = min(good, key=lambda c: (shape(c), c[0]))[1]
    cap = CAPS.get(variant, SELECTED_TOKENS_CAP)
    if cap is not None and (best.lsa_top_k or 0) * best.page_tokens > cap:
        # the budget bought more pages than a step needs: attend the cap, leave the rest unused
        best = best.model_copy(update={"lsa_top_k": max(1, cap // best.page_tokens)})
    return best


def model_geometry(model: Any) -> dict[str, int]:
    """group (query heads per KV head), head_dim and dtype_bytes of a model (or config)."""
    config = getattr(model, "config", model)
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    kvh = geometry.kv_heads(cfg) or 1
    dtype = getattr(model, "dtype", None) or getattr(cfg, "torch_dtype", None)
    return {
        "group": max(1, cfg.num_attention_heads // kvh),
        "head_dim": geometry.head_dim(cfg) or 64,
        "dtype_bytes": int(getattr(dtype, "itemsize", 4) or 4),
    }


def full_kv_bytes(model: Any, tokens: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes a plain DynamicCache(config) holds after `tokens` tokens (analytic)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers = cfg.num_hidden_layers
    kvh = geometry.kv_heads(cfg) or 0
    hd = geometry.head_dim(cfg) or 0
    per_tok = 2 * kvh * hd * dtype_bytes
    types = geometry.layer_types(cfg, n_layers, infer_sliding=False)
    sw = getattr(cfg, "sliding_window", None)
    managed = sliding = 0
    for t in types:
        if t == "sliding_attention" and sw:
            sliding += min(tokens, sw - 1) * per_tok
        else:
            managed += tokens * per_tok
    return {
        "managed_bytes": managed,
        "sliding_bytes": sliding,
        "total_bytes": managed + sliding,
        "bytes_per_token_managed": per_tok * sum(t != "sliding_attention" or not sw for t in types),
    }
