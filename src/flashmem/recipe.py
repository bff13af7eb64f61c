"""The recipe: what flashmem does when a user does not say otherwise.

`flashmem.attach(model)` (no config) and `FlashMemoryConfig.for_budget(budget,
tokens, model)` both build their config from here: RECIPE's keys, with the
window and the selected pages sized by the budget solver
(`flashmem.sizing.budget.budget_config`) so the device holds about `budget` x
the full cache's KV bytes after `tokens` tokens. Every key and constant names
the measurement it came from (docs/measurements.md). `configs/cpu-small.yaml`
is the recipe at 1/8 of an 8K prompt on SmolLM2-135M in fp32 (checked by
tests/test_recipe.py).

The experiment variants measured against the recipe (`flashmem:<variant>` in the
evaluation harness) live in the evaluation package,
`evaluation/flashmem_eval/variants.py`; `resolve_variant` looks a name up there.

A bare `FlashMemoryConfig()` is not the recipe: it is the seed article's layout
(CSA/HCA summaries, 128-token blocks, a 32K window), the base that YAML keys lay
over; below 32K tokens it compresses nothing.

Torch-free and imports nothing of flashmem but its errors, so the config and the
solver can both read it without an import circle.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashmem.errors import FlashMemError

# The recipe's config keys: 64-token stored blocks, 16-token pages scored by their int8
# mean key and re-ranked by their exact keys, 20 sink tokens, most of the budget on exact
# selected pages held as int8 (docs/measurements.md, "Selection by pages"). The solver adds
# gpu_cache_limit, lsa_top_k, lsa_min_blocks, csa_band_tokens and lsa_follow_pages.
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
    # 2K and 1/16): what was missing was the prompt's own attention (docs/measurements.md,
    # "The prompt attended exactly"). The prompt is read back from the tiers chunk by chunk
    # (cache/exact_prompt.py), so the device holds no more than the budget through it.
    "prefill_exact_tokens": 32768,
    # The solver sizes the budget with the open block full (63 tokens); while it holds fewer, the
    # bytes it leaves buy working-set pages, so every step uses the budget and none passes it
    # (Gemma3 at 2K and 1/16: 6 pages sized, up to 21 with the room; docs/results.md, "The
    # budget on every step").
    "lsa_open_room": True,
}
# From this budget up a selected page brings the page after it (the answer after
# its cue, `lsa_follow_pages: 1`); below it the pairs halve too few distinct pages
# and fidelity drops (docs/measurements.md, "Following pages").
FOLLOW_FROM_BUDGET = 1 / 8
# ... and again from this budget down, where a layer selects so few pages that losing the one
# after the cue loses the answer: held-out Gemma3 prompts at 1/32 kept 10/10 and 7/7 of the full
# cache's answers with it, 9/10 and 6/7 without (8K seed 3, 4K seed 7; none lost; 4K seed 13 and
# 16K seed 3 the same both ways), for +0.011-0.022 KL on SmolLM2 4K, still below SnapKV and
# StreamingLLM. At 1/16 it changed no answer and only added KL (docs/measurements.md, "Following
# pages below 1/8, looked at again").
FOLLOW_UP_TO_BUDGET = 1 / 32
# From this budget up, one entry per KV head stands for the sealed pages a step leaves out (their
# mass estimated from the index, their mean value: `rest_entry`), so attention keeps their share
# instead of renormalising over the picks. At 1/16 it gained two answers at 4K (SmolLM2 task
# families: 21 of the full cache's 22 items on the dev set against 20, 14 of 14 held out against
# 13; Gemma3 retrieval 39 of 39 dev and held-out prompts both ways) and lowered KL there (1/8:
# 21-35%, 1/16: 12-20%); at 8K it moved KL by -7% to +2% at 1/8 and +10-19% at 1/16 and lost one
# of 19 task items at 1/16 (a mixed trade, kept: docs/results.md, "Tasks at 8K with this
# recipe"). At 1/32 it lost an item (17 of 22 against 18): not below 1/16. One K/V pair per KV
# head (docs/results.md, "Summaries and following for aggregation and multivalue"). The static
# decode step has no rest entry (cache/static_step.py): a config with one does not get it.
REST_FROM_BUDGET = 1 / 16
# Target shares of the resident budget the solver aims at: window, selected pages, CSA band.
SHAPE: tuple[float, float, float] = (0.08, 0.7, 0.0)
# The window the solver sizes (SHAPE's 8%) is at most this many tokens; its bytes beyond buy
# selected pages (or, past SELECTED_TOKENS_CAP, the page cache and the re-rank's codes). Exact
# recent tokens cost 3.8x the bytes of int8 pages, and the pages a step selects hold the recent
# text it needs: SmolLM2 at 8K and 1/8, KL to the full cache 0.0023 and 0.0006 with 8 tokens
# against 0.0039 and 0.0007 with 32 (seeds 0 and 1) and 0.0060 and 0.0029 with the sized 128;
# at 4K and 1/8 0.00208 / 0.00153 against 0.00216 / 0.00155 in fewer bytes; Gemma3 at 8K and 16K
# held out, every answer and output the same; the SmolLM2 task families at 4K and 8K, the same
# items (docs/results.md, "A smaller window" and "A window capped at 8 tokens"). It was held at
# 32 while a crop (speculative decoding's rejected drafts) could remove only unsealed tokens;
# crops now unseal blocks (cache/generation.py). Budgets whose solver window is smaller keep it.
WINDOW_CAP: int | None = 8
# Selected pages a step attends, at most this many tokens per layer (on average over the
# layers), whatever the budget buys: past it a budget is a ceiling, not a target. At 1/8 the
# int8 working set buys a third of the context, 24K tokens per head at 64K, and decoding them
# every step made the recipe no faster than DynamicCache there (0.96x; 3.49x with the cap, one
# run). 4,096 is twice the 2,048 of ShadowKV and DeepSeek-V3.2's indexer and 1.5x what answered
# every Gemma3 prompt at 16K and 1/16. It binds from about 12K tokens at 1/8 and 25K at 1/16
# (docs/measurements.md, "A cap on the selected pages").
SELECTED_TOKENS_CAP: int | None = 4096

# `attach(model)` without a config: the budget, and the prompt length it is sized for
# when `tokens=` is not given (8K, the length the recipe was measured at most; no more
# than the model's own context). A longer prompt holds less than the budget (the window
# and the pages stay as sized; past about 12K tokens the cap above binds anyway); a
# shorter one holds more, up to everything it has seen.
DEFAULT_BUDGET = 1 / 8
DEFAULT_TOKENS = 8192
# The longest prompt the solver sizes for: 2**27 (134M) tokens, 13x the longest context
# a released model states (10M). It keeps every answer under a second.
MAX_TOKENS = 2**27


def recipe_keys(budget: float) -> dict[str, Any]:
    """RECIPE's keys at `budget`: with `lsa_follow_pages` from FOLLOW_FROM_BUDGET up and from
    FOLLOW_UP_TO_BUDGET down, and `rest_entry` from REST_FROM_BUDGET up."""
    follow = budget >= FOLLOW_FROM_BUDGET * (1 - 1e-6) or budget <= FOLLOW_UP_TO_BUDGET * (1 + 1e-6)
    rest = budget >= REST_FROM_BUDGET * (1 - 1e-6)
    return {**RECIPE, "lsa_follow_pages": 1 if follow else 0, "rest_entry": rest}


# Where the cap leaves room in the budget, the re-rank's candidates are scored by int4 codes of
# their keys held on the device (cache/rerank_codes.py), if those fit in the room: a GPU's
# decode step then reads no keys on the host and copies only new candidates' codes (issue 27;
# docs/accelerator.md). int4 ranks the needle's page as the exact keys do (docs/measurements.md,
# "Re-rank codes"). Llama-3.1-8B: at 1/8 by 64K tokens, at 1/16 by 128K, at 1/32 by 1M.
DEVICE_RERANK: dict[str, Any] = {"lsa_rerank_codec": "int4", "lsa_rerank_on_device": True}
# A model on the CPU instead scores an int8 copy of every sealed key (a scale per token and KV
# head, `lsa_rerank_mirror`, cache/rerank_codes.py KeyMirror) with one integer GEMM per layer, in
# place of the cold tier's fp32 keys: a quarter of the bytes a step reads to re-rank. SmolLM2 at
# 4K picked 99.6% of the exact keys' pages (top-1 token 100%); decode at 1/8, alternating in one
# run, tiny model 32K 3.06x DynamicCache against 2.51x, SmolLM2 8K 0.94x against 0.86x
# (docs/measurements.md, "An int8 key copy for the CPU's re-rank"). Memory cold tier only: the
# copy is 13% of an fp32 model's cold tier in RAM (allocated by doubling: up to 2x that), which a
# disk tier is there to save.
HOST_RERANK: dict[str, Any] = {"lsa_rerank_mirror": "int8"}
# A model on the CPU with a disk cold tier (exact codes) reads a step's pages straight from the
# files (`DiskStore.gather_pages`), with no prefetcher: its loader threads hold whole blocks in a RAM
# buffer, the RAM the disk tier is there to save, and whole blocks are read where pages would do.
# SmolLM2 at 8K and 1/8 (`decode_rss_steps.py --prefetch-threads 2` against 0): RSS 7.6x the budget
# against 1.13x at the decode steps' peak, 369.5 MB read from disk a step against 194.7 MB, steps of
# 1.0-1.4 s against 0.5 s (docs/results.md, "A disk tier's decode step in bounded reads"). Applied
# to every config, the recipe's or one written by hand, by `prefetch_threads: auto` (the default)
# when the cache is made for a model on a CPU (`FlashMemoryConfig.prefetch_threads_on`).
HOST_DISK: dict[str, Any] = {"prefetch_threads": 0}
# A model on the CPU also decides near ties exactly (`exact_on_doubt`, cache/doubt.py): a step
# whose top two next-token logits are within 0.5 nats is run again attending every earlier token
# exactly, so greedy decoding picks what the full cache picks there. Issue 31's multiquery and
# vartrack losses at 1/16 were all such ties: SmolLM2 at 4K kept 27 and 10 of the full cache's 33
# and 17 items without it, 33 and 17 with it, and every item on the other four families and on
# held-out seeds (docs/results.md, "Near ties decided exactly"). A redo reads the whole cold tier,
# which a CPU's memory tier holds in the same RAM; on an accelerator it would cross the link, so
# it is not in the device recipe. Its cost is capped (`exact_on_doubt_share`, 1/8 of the steps
# past the first 8 redos): SmolLM2 at 8K decoded at 1.14x the mean step without it, the same
# median (docs/results.md, "A cap on the redone steps").
# A near tie whose two tokens hold under 5% of the probability together is not redone
# (`exact_on_doubt_min_mass`): the model prefers neither (random weights give every step such a
# flat tie). On issue 31's multiquery and vartrack prompts at 1/16 the 153 redone ties held
# 0.091-0.996, the 20 whose redo changed the token 0.104-0.918 (docs/results.md, "Near ties in a
# flat distribution").
# Memory cold tier with exact codes only (a redo reads the exact K/V back).
HOST_DOUBT: dict[str, Any] = {"exact_on_doubt": 0.5, "exact_on_doubt_min_mass": 0.05}
# What room is left after them holds, per layer and KV head, the pages that most recently left
# the selection (`lsa_cache_pages`, cache/working_set.py): a page that comes back is not copied
# again. Gemma3-270m at 16K and 1/8 (the cap binds) on a KJV prompt: a step's selected pages the
# device held went from 0.767 (the last step's selection only) to 0.873 with half the selection's
# pages more, the link's bytes per step from 1.36 MB to 0.61 MB (docs/accelerator.md, "A page
# cache past the selection"). A model on the CPU gets neither.
# At most this many times the selected pages: past 2x the held share stopped growing (0.94 -> 0.955
# at 4K from 2x to 4x, 0.977 both at 16K), and the room past it is better left unused.
PAGE_CACHE_MAX_SELECTIONS = 4


@dataclass(frozen=True)
class Variant:
    """What the budget solver lays its sizes over: config keys (the recipe's unless a
    variant changes them), the target split of the resident budget (window, selected
    pages, CSA band), the cap on the window it sizes and on a step's selected tokens (None: no
    cap) and the re-rank keys taken where the cap leaves room for them (None: never)."""

    keys: Mapping[str, Any] = field(default_factory=lambda: dict(RECIPE))
    shape: tuple[float, float, float] = SHAPE
    cap: int | None = SELECTED_TOKENS_CAP
    window_cap: int | None = WINDOW_CAP
    device_rerank: Mapping[str, Any] | None = field(default_factory=lambda: dict(DEVICE_RERANK))
    # the room the cap and the codes leave holds pages that left the selection (lsa_cache_pages)
    device_page_cache: bool = True


def resolve_variant(name: str) -> Variant:
    """'default' is the recipe; any other name is an experiment variant of the
    evaluation package (`flashmem_eval.variants.VARIANTS`, imported on demand)."""
    if not isinstance(name, str):
        raise FlashMemError(f"variant: {name!r} is not allowed; allowed: a variant name such as 'default'")
    if name == "default":
        return Variant()
    try:
        from flashmem_eval.variants import variant
    except ImportError:
        raise FlashMemError(
            f"variant: {name!r} is an experiment variant of the evaluation package flashmem_eval, which "
            "is not importable here; allowed: 'default' (the recipe), or install the checkout (pip install -e .)"
        ) from None
    return variant(name)


def check_budget(budget: Any) -> float:
    """`budget` as a float in (0, 1], or a one-line FlashMemError."""
    ok = isinstance(budget, numbers.Real) and not isinstance(budget, bool)
    value = float(budget) if ok else math.nan
    if not (ok and math.isfinite(value) and 0 < value <= 1):
        raise FlashMemError(
            f"budget: {budget!r} is not allowed; allowed: a number with 0 < budget <= 1 "
            "(the device-resident fraction of the full cache's KV bytes, e.g. 1/8)"
        )
    return value


def check_tokens(tokens: Any, name: str = "tokens") -> int:
    """`tokens` as an int in 1..MAX_TOKENS, or a one-line FlashMemError."""
    try:
        value = operator.index(tokens) if not isinstance(tokens, bool) else 0
    except TypeError:
        value = 0
    if not 1 <= value <= MAX_TOKENS:
        raise FlashMemError(
            f"{name}: {tokens!r} is not allowed; allowed: an integer from 1 to {MAX_TOKENS:,} "
            "(the prompt length to size for, e.g. 8192; flashmem.sizing.units.parse_tokens reads '8K')"
        )
    return value


def default_tokens(model_config: Any) -> int:
    """The prompt length `attach(model)` sizes the recipe for without `tokens=`:
    DEFAULT_TOKENS, or the model's context (`max_position_embeddings`) when shorter."""
    ctx = getattr(model_config, "max_position_embeddings", None)
    if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx >= 1:
        return min(DEFAULT_TOKENS, ctx)
    return DEFAULT_TOKENS
