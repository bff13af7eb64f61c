"""The experiment variants: what the measurements compared the recipe with.

Each variant is the recipe (`flashmem.recipe.RECIPE`) with a few config keys
changed, or with another split of the budget (SHAPES) or another cap on a step's
selected pages (CAPS). The names are the ones in docs/measurements.md and
results/ (`flashmem:<variant>` in the harness, `--variant` in the benchmarks).
`FlashMemoryConfig.for_budget(..., variant=name)` and
`flashmem.sizing.budget.budget_config` resolve a name through `variant(name)`;
the library itself knows only the recipe ('default').
"""

from __future__ import annotations

from typing import Any

from flashmem.errors import FlashMemError
from flashmem.recipe import RECIPE, SELECTED_TOKENS_CAP, SHAPE, WINDOW_CAP, Variant

__all__ = ["CAPS", "SHAPES", "VARIANTS", "WINDOW_CAPS", "variant"]

# Config keys laid over the budget-mapped default (the recipe).
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
    # the re-rank scored by codes of the candidates' keys (docs/accelerator.md), on the host, and
    # by exact keys everywhere (the recipe before it held int4 codes on the device past the page cap)
    "rrcode-int4": {**RECIPE, "lsa_rerank_codec": "int4"},
    "rrcode-sign": {**RECIPE, "lsa_rerank_codec": "sign"},
    "rrexact": {**RECIPE, "lsa_rerank_codec": "exact"},
    # the in-place re-rank (on the host) scoring a host copy of the sealed keys (`lsa_rerank_mirror`):
    # bf16 (one GEMM per layer in bf16) or int8 per token (`torch._int_mm`)
    "mirror-bf16": {**RECIPE, "lsa_rerank_codec": "exact", "lsa_rerank_mirror": "bf16"},
    "mirror-int8": {**RECIPE, "lsa_rerank_codec": "exact", "lsa_rerank_mirror": "int8"},
    # the working set in the model's dtype (the recipe until "An int8 working set");
    # wsint8 names the recipe in that section's runs
    "wsmodel": {**RECIPE, "working_set_codec": "model"},
    "wsint8": {**RECIPE, "working_set_codec": "int8"},
    "restfollow": {**RECIPE, "rest_entry": True, "lsa_follow_pages": 1},
    "int8": {**RECIPE, "cold_codec": "int8"},
    "int4": {**RECIPE, "cold_codec": "int4"},
    "b128": {**RECIPE, "hca_chunk_size": 128},
    # exact_on_doubt (cache/doubt.py): a decode step whose top two logits are this close (nats)
    # runs again with every earlier token attended exactly (issue 31's near ties; stop 60)
    # Since stop 61 a model on the CPU gets it in the recipe (recipe.HOST_DOUBT) with its cost
    # capped (exact_on_doubt_share 1/8): nodoubt is the CPU recipe before, doubt1 without the cap
    "doubt": {**RECIPE, "exact_on_doubt": 0.5},
    "doubt0.2": {**RECIPE, "exact_on_doubt": 0.2},
    "doubt1": {**RECIPE, "exact_on_doubt": 0.5, "exact_on_doubt_share": 1.0},
    "nodoubt": {**RECIPE, "exact_on_doubt": 0.0},
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
    # a second hop (issue 31): a share of the selected pages to pages whose mean values look like
    # the best selected ones (fb8: 1/8 of them, fb4: 1/4)
    "fb8": {**RECIPE, "lsa_feedback_share": 0.125},
    "fb4": {**RECIPE, "lsa_feedback_share": 0.25},
    "fb4s1": {**RECIPE, "lsa_feedback_share": 0.25, "lsa_feedback_seeds": 1},
    # halfway between the even split and the profile's
    "half": {**RECIPE, "lsa_layer_profile_weight": 0.5},
    # a selection serves 2 or 4 decode steps (`lsa_select_every`; docs/accelerator.md, "A
    # selection that serves several steps")
    "every2": {**RECIPE, "lsa_select_every": 2},
    "every4": {**RECIPE, "lsa_select_every": 4},
    # the decode step with fixed shapes and no host reads (`decode_step: static`,
    # cache/static_step.py): ranked by the index alone, no page cache; with `lsa_fetch_share` s
    # at most s of a step's pages enter the working set per step (the rest wait a step)
    "static": {**RECIPE, "lsa_rerank": 1, "lsa_cache_pages": 0, "decode_step": "static"},
    "static-f50": {**RECIPE, "lsa_rerank": 1, "lsa_cache_pages": 0, "decode_step": "static", "lsa_fetch_share": 0.5},
    "static-f25": {**RECIPE, "lsa_rerank": 1, "lsa_cache_pages": 0, "decode_step": "static", "lsa_fetch_share": 0.25},
}
# ... re-ranked as the recipe is (4x the pages as candidates), by their keys' int4 codes held on
# the device in the budget (no 256-candidate floor: at 4K its codes alone fill a 1/16 budget);
# with a share, the candidates' codes are read under it too
_STATIC_RR = {**RECIPE, "lsa_cache_pages": 0, "decode_step": "static", "lsa_rerank_codec": "int4",
              "lsa_rerank_on_device": True, "lsa_rerank_min_pages": 0}  # fmt: skip
VARIANTS.update(
    {
        "static-rr": _STATIC_RR,
        "static-rr-f50": {**_STATIC_RR, "lsa_fetch_share": 0.5},
        "static-rr-f25": {**_STATIC_RR, "lsa_fetch_share": 0.25},
        # fewer candidates (2x the pages) or 1-bit codes: more of the budget left to pages
        "static-rr2": {**_STATIC_RR, "lsa_rerank": 2},
        "static-rrs": {**_STATIC_RR, "lsa_rerank_codec": "sign"},
        # the same config's eager step (it lends lsa_open_room's pages, which the static step does not)
        "rrdev": {**_STATIC_RR, "decode_step": "eager"},
        # the recipe with an 8-token window, the pages filling the rest (up to the cap)
        "win8": {**RECIPE, "gpu_cache_limit": 8},
        # ... and with the rest entry (the left-out pages' mass and mean value, one entry per KV head)
        "winrest": {**RECIPE, "gpu_cache_limit": 8, "rest_entry": True},
        # a 32-token window (speculative decoding's default 20-token drafts stay croppable), with the rest entry
        "win32": {**RECIPE, "gpu_cache_limit": 32},
        "win32rest": {**RECIPE, "gpu_cache_limit": 32, "rest_entry": True},
        # the recipe without the rest entry it takes from 1/16 up (REST_FROM_BUDGET)
        "norest": {**RECIPE, "rest_entry": False},
        # 8-token pages: twice the picks of half the tokens each (and twice the index vectors)
        "page8": {**RECIPE, "lsa_page_tokens": 8},
    }
)
# Variants that change the split of the resident budget (window, selected pages, CSA band)
# rather than config keys; the recipe's is flashmem.recipe.SHAPE.
SHAPES: dict[str, tuple[float, float, float]] = {"balanced": (0.4, 0.4, 0.0), "windowed": (0.6, 0.25, 0.0)}
VARIANTS.update({name: dict(RECIPE) for name in SHAPES})
# Variants with another cap on a step's selected tokens (None: none, the recipe before the
# cap); the recipe's is flashmem.recipe.SELECTED_TOKENS_CAP.
CAPS: dict[str, int | None] = {"nocap": None, "cap8k": 8192}
VARIANTS.update({name: dict(RECIPE) for name in CAPS})
# Variants with another cap on the window the solver sizes (None: none, the recipe before
# "A smaller window"); the recipe's is flashmem.recipe.WINDOW_CAP.
# wincap8: a cap of 8, checked as a variant before it became the recipe's (stop 47; its result
# files name it); wincap32: the recipe's cap before that.
WINDOW_CAPS: dict[str, int | None] = {"sizedwin": None, "wincap8": 8, "wincap32": 32}
VARIANTS.update({name: dict(RECIPE) for name in WINDOW_CAPS})
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


def variant(name: str) -> Variant:
    """The solver's inputs for a variant name: its keys, budget split and caps."""
    if name not in VARIANTS:
        raise FlashMemError(f"variant: {name!r} is not known; allowed: {', '.join(VARIANTS)}")
    return Variant(
        keys=dict(VARIANTS[name]),
        shape=SHAPES.get(name, SHAPE),
        cap=CAPS.get(name, SELECTED_TOKENS_CAP),
        # a variant that splits the budget another way sizes its window uncapped
        window_cap=WINDOW_CAPS.get(name, None if name in SHAPES else WINDOW_CAP),
    )
