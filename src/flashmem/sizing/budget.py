"""Budget -> config: the FlashMemory config whose device-resident KV bytes are
about a given fraction of the full cache's at a prompt length.

The budget is device-resident KV bytes / full-cache KV bytes over the managed
layers (docs/design.md, "Budget"). `budget_config` solves it with
`flashmem.sizing.tiers.tier_counts`, so the predicted fraction at `tokens` is
as close to the budget as the grid allows; what a cache really holds is
measured from its tensors (`memory_report()["device_resident_bytes"]`).
`FlashMemoryConfig.for_budget` is the public entry point. Torch-free.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashmem import policies
from flashmem.config import FlashMemoryConfig, set_budget_solver
from flashmem.errors import BudgetWarning, ConfigError, FlashMemError
from flashmem.models import geometry
from flashmem.recipe import (
    HOST_DOUBT,
    HOST_RERANK,
    PAGE_CACHE_MAX_SELECTIONS,
    check_budget,
    check_tokens,
    recipe_keys,
    resolve_variant,
)
from flashmem.sizing.hardware import IN_PLACE_CANDIDATES
from flashmem.sizing.tiers import (
    candidate_code_bytes,
    index_bytes,
    rerank_candidates,
    tier_counts,
    working_set_scale,
)

# Recent query positions each managed layer keeps for the attention-mass fusion
# rule (the cache's summaries read it from here).
RECENT_QUERY_TOKENS = 8


def predicted_ratio(
    cfg: FlashMemoryConfig,
    tokens: int,
    group: int = 1,
    head_dim: int = 64,
    dtype_bytes: int = 4,
    peak: bool = False,
) -> float:
    """Resident token-equivalents / tokens, per managed layer and KV head.

    peak: the most held on any step around `tokens` (the open block full,
    `tier_counts(peak=True)`): what the solver sizes, so the budget holds on every
    step, not only at lengths where a block was just sealed (the open block alone is
    up to 63 tokens, 25% of a 1/16 budget at 4K).

    K+V entries count 1; the index counts its declared bytes over the bytes of
    one token's K+V (2 * head_dim * dtype_bytes); the cache also keeps the last
    RECENT_QUERY_TOKENS queries of each of the `group` query heads per KV head
    (for the fusion weights): 8 * group key-sized vectors.
    """
    c = tier_counts(cfg, tokens, peak)
    qbuf = 0.5 * RECENT_QUERY_TOKENS * group if tokens > 0 and cfg.use_summaries else 0.0
    index = index_bytes(cfg, c, head_dim, dtype_bytes) / (2 * head_dim * dtype_bytes)
    # a coded working set (working_set_codec) counts its coded bytes
    ws_saved = (c.working_set + c.page_cache) * (1 - working_set_scale(cfg, head_dim, dtype_bytes))
    return (c.resident_kv - ws_saved + index + qbuf) / max(1, tokens)


def budget_config(
    budget: float,
    tokens: int,
    variant: str = "default",
    group: int = 1,
    head_dim: int = 64,
    dtype_bytes: int = 4,
    *,
    device_codes: bool = True,
    **overrides: Any,
) -> FlashMemoryConfig:
    """A config whose predicted device-resident fraction at `tokens` is about `budget`, on
    every step around that length (`predicted_ratio(peak=True)`: the open block full).

    Searched: selected pages k (lsa_top_k), near band (multiple of the block
    size, only with summaries) and window W (multiple of 8, at most
    flashmem.recipe.WINDOW_CAP; a `gpu_cache_limit` the caller or the variant
    names is kept, and the pages fill the rest). Among configs at
    most 3% over the target that come within 3% of the fullest such config
    (else the closest one) the one nearest the variant's split of the resident
    tokens (flashmem.recipe.SHAPE: window 8% / selected pages 70% / CSA entries 0%)
    is taken, so the selection from the cold tier is used whenever the budget
    allows a page.
    The selected pages are capped at flashmem.recipe.SELECTED_TOKENS_CAP tokens:
    at long prompts the config holds less than the budget and each step attends
    a bounded number of tokens. Where that leaves room for them, the re-rank's
    candidate codes are held on the device (flashmem.recipe.DEVICE_RERANK) unless
    `device_codes` is False (a model on a CPU, where the device and the cold tier
    are the same RAM and the codes would cost compute and save nothing), or the
    caller or the variant names a re-rank codec. With `device_codes` False the re-rank
    scores an int8 host copy of the keys instead (flashmem.recipe.HOST_RERANK, memory
    cold tier only), near ties are decided exactly (flashmem.recipe.HOST_DOUBT, memory
    cold tier with exact codes only). A disk tier on a CPU is read without a prefetcher
    whatever the config's origin (`prefetch_threads: auto`, flashmem.recipe.HOST_DISK).
    Small budgets at short lengths can be unreachable (sinks + HCA entries +
    index + the open block already exceed them): the closest config is returned
    and the measured fraction says so.

    variant: 'default' (the recipe) or an experiment variant of
    `flashmem_eval.variants` (its keys, split and cap). Bad arguments raise a
    one-line FlashMemError; `tokens` is at most flashmem.recipe.MAX_TOKENS. The
    recipe answers in about 0.1 s at any length; with summaries the 33 band sizes
    make it about 30x longer (seconds past a million tokens).
    """
    budget = check_budget(budget)
    tokens = check_tokens(tokens)
    group, head_dim = _check_count(group, "group"), _check_count(head_dim, "head_dim")
    if dtype_bytes not in DTYPE_SIZES or isinstance(dtype_bytes, bool):
        raise FlashMemError(f"dtype_bytes: {dtype_bytes!r} is not allowed; allowed: one of {DTYPE_SIZES}")
    spec = resolve_variant(variant)
    base = _base_config(spec.keys, budget, overrides)
    target = budget * tokens
    ratio = _ratio_of(base, tokens, group, head_dim, dtype_bytes, peak=True)
    per_page = base.page_tokens * working_set_scale(base, head_dim, dtype_bytes)
    bands = range(0, 33) if base.use_summaries else [0]  # the band is dropped without summaries
    counts = _page_counts(int(target / per_page) + 9)

    def at_window(w: int) -> list[_Candidate]:
        return [
            (abs(r - budget) / budget, w, k, band, r) for k in counts for band in bands for r in [ratio(w, k, band)]
        ]

    named = set(overrides) | set(spec.keys)
    if "gpu_cache_limit" in named:
        # a window the caller or the variant names stands: the pages fill the rest
        cands = at_window(base.gpu_cache_limit)
    else:
        cands = _candidates(ratio, budget, tokens, counts, bands)
    _, w, k, band, got = _nearest_shape(cands, budget, spec.shape, target, per_page, base)
    if spec.window_cap is not None and w > spec.window_cap and "gpu_cache_limit" not in named:
        # the sized window is capped (flashmem.recipe.WINDOW_CAP): the pages fill the rest
        _, w, k, band, got = _nearest_shape(at_window(spec.window_cap), budget, spec.shape, target, per_page, base)
    if got > 1.03 * budget:
        # sinks, the open block and the index alone pass it: say so, not silently hold more
        warnings.warn(
            f"budget {budget:g} is not reachable at {tokens} tokens: the closest config holds {got:.3f} of the "
            f"full cache at its peak ({k} selected pages); allowed: a budget of at least {got:.3f}, or a longer prompt",
            BudgetWarning,
            stacklevel=3,
        )
    if k == 0 and base.lsa_rerank_on_device and base.lsa_rerank > 1:
        # the held codes of the candidate floor took the room: a re-rank with nothing to select
        raise FlashMemError(
            f"budget_config: lsa_rerank_on_device holds {base.lsa_rerank_min_pages}+ candidate pages' "
            f"codes, which leave no room for a selected page at budget {budget:g} and {tokens} tokens; "
            "allowed: a larger budget or prompt, a smaller lsa_rerank_min_pages, or lsa_rerank_on_device: false"
        )
    cap = spec.cap
    if cap is not None and k * base.page_tokens > cap:
        # the budget bought more pages than a step needs: attend the cap, leave the rest unused
        k = max(1, cap // base.page_tokens)
        sized = _sized(base, w, k, band)
        if not device_codes:
            return _on_host(sized, tokens, named)
        rerank_keys = spec.device_rerank
        if rerank_keys and base.lsa_rerank > 1 and not set(rerank_keys) & named:
            # ... or let the re-rank's candidate codes use the room, where they fit in it
            coded = sized.model_copy(update=dict(rerank_keys))
            if predicted_ratio(coded, tokens, group, head_dim, dtype_bytes, peak=True) <= budget:
                sized = coded
        if spec.device_page_cache and "lsa_cache_pages" not in named:
            # ... and what is left holds pages that left the selection (lsa_cache_pages)
            sized = _with_page_cache(sized, budget, tokens, group, head_dim, dtype_bytes)
        return FlashMemoryConfig(**sized.model_dump())
    sized = _sized(base, w, k, band)
    return sized if device_codes else _on_host(sized, tokens, named)


def _on_host(cfg: FlashMemoryConfig, tokens: int, named: set[str]) -> FlashMemoryConfig:
    """A model on a CPU: the host's re-rank keys and near ties decided exactly, where they
    apply (a disk tier's reads without a prefetcher are `prefetch_threads: auto`'s, settled when
    the cache is made: flashmem.recipe.HOST_DISK)."""
    return _with_host_doubt(_with_host_mirror(cfg, tokens, named), named)


def _with_host_doubt(cfg: FlashMemoryConfig, named: set[str]) -> FlashMemoryConfig:
    """A model on a CPU: near ties decided exactly (flashmem.recipe.HOST_DOUBT), where a redo
    can read the exact K/V back from a memory cold tier at real positions, unless the caller or
    the variant names `exact_on_doubt` (a floor it names, `exact_on_doubt_min_mass`, stands).
    Not with a disk tier (a redo would read all of it) nor a lossy one, and not with
    `position_mode: window` (the config refuses the pair)."""
    if (
        "exact_on_doubt" in named
        or cfg.cold_store != "memory"
        or cfg.cold_codec != "exact"
        or cfg.cold_low_rank != "none"
        or cfg.position_mode == "window"
    ):
        return cfg
    keys = {k: v for k, v in HOST_DOUBT.items() if k not in named}
    return FlashMemoryConfig(**cfg.model_copy(update=keys).model_dump())


def _with_host_mirror(cfg: FlashMemoryConfig, tokens: int, named: set[str]) -> FlashMemoryConfig:
    """A model on a CPU: the re-rank scores an int8 copy of the sealed keys in place
    (flashmem.recipe.HOST_RERANK) where, at `tokens`, it would score exact keys from a memory
    cold tier in place (candidates at least 1/IN_PLACE_CANDIDATES of the pages; fewer are
    gathered, and the copy would only take RAM), unless the caller or the variant names the
    re-rank's keys. Not with a disk tier: there the RAM is what the budget saves, and the copy
    would be about as large as a 1/8 budget."""
    keys = set(HOST_RERANK) | {"lsa_rerank_codec"}
    if cfg.lsa_rerank <= 1 or cfg.lsa_rerank_codec != "exact" or cfg.cold_store != "memory" or keys & named:
        return cfg
    counts = tier_counts(cfg, tokens)
    pages = counts.sealed_blocks * cfg.pages_per_block
    if IN_PLACE_CANDIDATES * rerank_candidates(cfg, pages, counts.working_set // cfg.page_tokens) < pages:
        return cfg
    return FlashMemoryConfig(**cfg.model_copy(update=dict(HOST_RERANK)).model_dump())


def _with_page_cache(
    cfg: FlashMemoryConfig, budget: float, tokens: int, group: int, head_dim: int, dtype_bytes: int
) -> FlashMemoryConfig:
    """`cfg` with as many `lsa_cache_pages` as the budget has room for at `tokens` (peak), up to
    the sealed pages not selected and PAGE_CACHE_MAX_SELECTIONS x the selected ones; unchanged
    when there is no room for one."""
    counts = tier_counts(cfg, tokens, peak=True)
    selected = counts.working_set // cfg.page_tokens
    free = min(counts.sealed_blocks * cfg.pages_per_block - selected, PAGE_CACHE_MAX_SELECTIONS * selected)
    room = budget - predicted_ratio(cfg, tokens, group, head_dim, dtype_bytes, peak=True)
    per_page = cfg.page_tokens * working_set_scale(cfg, head_dim, dtype_bytes) / max(1, tokens)
    n = min(free, int(room / per_page)) if room > 0 and free > 0 else 0
    while n > 0:  # the arithmetic above is predicted_ratio's; checked, and a page fewer on rounding
        cached = cfg.model_copy(update={"lsa_cache_pages": n})
        if predicted_ratio(cached, tokens, group, head_dim, dtype_bytes, peak=True) <= budget:
            return cached
        n -= 1
    return cfg


def _base_config(variant_keys: Any, budget: float, overrides: dict[str, Any]) -> FlashMemoryConfig:
    """The variant's keys (the recipe's follow pages and rest entry at `budget` unless set) under
    the caller's overrides. The rest entry is left out where the caller or the variant names a
    decode step without one (static, graph) and does not name it."""
    keys = dict(variant_keys)
    at_budget = recipe_keys(budget)
    keys.setdefault("lsa_follow_pages", at_budget["lsa_follow_pages"])
    if overrides.get("position_mode") == "window":
        keys["prefill_exact_tokens"] = 0  # an exact prompt attends at real positions
    keys.update(overrides)
    if "rest_entry" not in keys:
        keys["rest_entry"] = at_budget["rest_entry"] and keys.get("decode_step", "eager") == "eager"
    return FlashMemoryConfig(**keys)


_Candidate = tuple[float, int, int, int, float]  # (distance to the budget, W, k, band blocks, ratio)


def _candidates(
    ratio: Callable[[int, int, int], float], budget: float, tokens: int, page_counts: list[int], bands: Any
) -> list[_Candidate]:
    """Per page count and band: the window (multiple of 8) at which the ratio reaches the budget, and the one below."""
    step = 8
    cands: list[_Candidate] = []
    for k in page_counts:
        for band in bands:
            lo, hi = 1, max(1, tokens // step)
            while lo < hi:  # smallest W (in steps) whose ratio reaches the budget
                mid = (lo + hi) // 2
                if ratio(mid * step, k, band) >= budget:
                    hi = mid
                else:
                    lo = mid + 1
            for ws in {max(1, lo - 1), lo}:
                r = ratio(ws * step, k, band)
                cands.append((abs(r - budget) / budget, ws * step, k, band, r))
    return cands


def _nearest_shape(
    cands: list[_Candidate],
    budget: float,
    split: tuple[float, float, float],
    target: float,
    per_page: float,
    base: FlashMemoryConfig,
) -> _Candidate:
    """Of the candidates that use the budget (see budget_config), the one nearest the split (window, pages, CSA)."""
    # Never more than 3% over the budget; of those, the ones that use it fully
    # (within 3% of the fullest: a page is a coarse step at short prompts).
    under = [c for c in cands if c[4] <= 1.03 * budget]
    # a config that selects a page beats a fuller one that selects none: with no page the cold
    # tier is never read (Gemma3 at 4,050 tokens and 1/32 took a 16-token window and no page,
    # 1.029x the budget, over a page and an 8-token window at 0.998x, and lost its needle)
    under = [c for c in under if c[2] > 0] or under
    if under:
        fullest = max(c[4] for c in under)
        good = [c for c in under if c[4] >= fullest - 0.03 * budget]
    else:
        good = [min(cands, key=lambda c: c[0])]
    sw, ss, sc = split
    B = base.hca_chunk_size

    def shape(c: _Candidate) -> float:
        w = c[1] / target - sw
        sel = c[2] * per_page / target - ss  # its share of the bytes
        csa = c[3] * B / base.csa_chunk_size / target - sc
        return w * w + sel * sel + csa * csa  # products: a tiny budget gives inf, not OverflowError

    return min(good, key=lambda c: (shape(c), c[0]))


def _sized(base: FlashMemoryConfig, window: int, pages: int, band_blocks: int) -> FlashMemoryConfig:
    """`base` with the solver's sizes: window, selected pages, near band (in blocks)."""
    return base.model_copy(
        update={
            "gpu_cache_limit": window,
            "csa_band_tokens": band_blocks * base.hca_chunk_size,
            "lsa_top_k": pages,
            "lsa_min_blocks": min(1, pages),
        }
    )


def _ratio_of(
    base: FlashMemoryConfig, tokens: int, group: int, head_dim: int, dtype_bytes: int, peak: bool = False
) -> Callable[[int, int, int], float]:
    """predicted_ratio(_sized(base, w, k, band), tokens, ..., peak) as a function of (w, k, band),
    the same arithmetic in the same order without building a config per call (the solver
    calls it thousands of times; tests/test_budget_validation.py checks it equals
    predicted_ratio)."""
    B, ppb, pt = base.hca_chunk_size, base.pages_per_block, base.page_tokens
    sinks = min(base.sink_tokens, tokens)
    rest = tokens - sinks
    per = policies.SCORERS[base.lsa_scorer].index_bytes(base, head_dim, dtype_bytes)
    rest_sum = 4 * head_dim if base.keeps_rest_entry else 0
    unit = 2 * head_dim * dtype_bytes
    keep = 1 - working_set_scale(base, head_dim, dtype_bytes)
    qbuf = 0.5 * RECENT_QUERY_TOKENS * group if tokens > 0 and base.use_summaries else 0.0
    summaries, hca, per_block = base.use_summaries, base.keeps_hca_entries, base.csa_per_block
    denom = max(1, tokens)
    spare = base.lsa_cache_pages

    def ratio(w: int, k: int, band: int) -> float:
        window = min(w, rest)
        history = rest - window
        sealed = history // B
        open_block = min(B - 1, history) if peak else history - sealed * B
        csa = min(sealed, band) * per_block if summaries else 0
        pages = sealed * ppb
        selected = max(0, min(pages, max(k, min(1, k)))) if pages > 0 else 0
        ws = (selected + (max(0, min(spare, pages - selected)) if selected else 0)) * pt
        resident = sinks + window + open_block + csa + (sealed if hca else 0) + ws
        index = sealed * per.per_block + sealed * B * per.per_token + (rest_sum if sealed else 0)
        index = (index + candidate_code_bytes(base, pages, selected, head_dim, dtype_bytes)) / unit
        return (resident - ws * keep + index + qbuf) / denom

    return ratio


# Selected-page counts the solver tries: every count to 64, steps of 8 to _FINE_PAGES
# (long prompts at 1/8 select hundreds), then steps of 3% (a budget that buys more than
# _FINE_PAGES pages is capped to SELECTED_TOKENS_CAP anyway): the search grows with
# log(tokens), so 2**27 tokens answer in well under a second.
_FINE_PAGES = 8192


def _page_counts(top: int) -> list[int]:
    top = max(73, top)
    ks = [*range(0, 65), *range(72, min(top, _FINE_PAGES), 8)]
    k = _FINE_PAGES
    while k < top:
        ks.append(k)
        k = max(k + 8, int(k * 1.03) // 8 * 8)
    return ks


DTYPE_SIZES = (1, 2, 4, 8)  # bytes per element of the model's K/V


def _check_count(value: Any, name: str, most: int = 2**16) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise FlashMemError(f"{name}: {value!r} is not allowed; allowed: an integer from 1 to {most}")
    return value


def model_geometry(model: Any) -> dict[str, int]:
    """group (query heads per KV head), head_dim and dtype_bytes of a model: a
    transformers model or config, or a model the calculator knows (a built-in name
    such as 'llama-3.1-8b', an HF folder, a .gguf file or a ModelSpec; see
    `flashmem.sizing.specs.resolve_model`). A model `flashmem.load_model` loads
    (smollm2, gemma3-270m) counts in fp32, as it loads; any other name in the
    calculator's dtype (bfloat16 for the hub models). Anything else: one line."""
    from flashmem.sizing.specs import ModelSpec

    if isinstance(model, str | Path | ModelSpec | dict):
        try:
            return _spec_geometry(model)
        except ConfigError as exc:  # the calculator's message names its flag
            raise ConfigError(str(exc).replace("--model:", "model:", 1)) from None
        except FlashMemError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise FlashMemError(
                f"model: {str(model)[:80]!r} could not be read ({type(exc).__name__}); "
                "allowed: a model name the calculator knows (flashmem estimate --help), "
                "an HF folder or .gguf file, or a transformers model or config"
            ) from None
    try:
        config = getattr(model, "config", model)
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        kvh = geometry.kv_heads(cfg) or 1
        heads = int(cfg.num_attention_heads)
        dtype = getattr(model, "dtype", None) or getattr(cfg, "torch_dtype", None)
        out = {
            "group": max(1, heads // kvh),
            "head_dim": int(geometry.head_dim(cfg) or 64),
            "dtype_bytes": int(getattr(dtype, "itemsize", 4) or 4),
        }
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        raise FlashMemError(
            f"model: a {type(model).__name__} object is not allowed; allowed: a transformers model or its "
            "config, or a model name the calculator knows (flashmem estimate --help)"
        ) from None
    _check_count(out["group"], "model's query heads per KV head")
    _check_count(out["head_dim"], "model's head_dim")
    return out


def _spec_geometry(model: Any) -> dict[str, int]:
    from flashmem.models.registry import BUILTINS
    from flashmem.sizing.specs import FullAttention, resolve_model
    from flashmem.sizing.units import DTYPE_BYTES

    spec = resolve_model(model)  # a ConfigError naming the model and what is known
    managed = [layer for layer, _ in spec.layer_positions() if isinstance(layer, FullAttention)]
    if not managed:
        raise FlashMemError(
            f"model: {spec.name!r} has no full-attention layers for flashmem to manage ({spec.summary()}); "
            "allowed: a model with MHA/GQA layers"
        )
    facts = BUILTINS[spec.name].facts if spec.name in BUILTINS else {}
    heads, kvh = facts.get("num_attention_heads"), facts.get("num_kv_heads")
    return {
        # only CSA/HCA summaries' query buffer reads the group (not the recipe's): 1 when unknown
        "group": max(1, heads // kvh) if heads and kvh else 1,
        "head_dim": managed[0].head_dim,
        "dtype_bytes": 4 if spec.name in BUILTINS else DTYPE_BYTES[spec.dtype],
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


def for_budget(
    budget: float, tokens: int, model: Any, variant: str, given: dict[str, int | None], **overrides: Any
) -> FlashMemoryConfig:
    """`FlashMemoryConfig.for_budget` (its docstring says what it returns): the model's
    geometry, where `given` (group, head_dim, dtype_bytes) leaves it open, then `budget_config`."""
    geo = model_geometry(model) if model is not None else {}
    defaults = {"group": 1, "head_dim": 64, "dtype_bytes": 4}
    sizes = {k: v if v is not None else geo.get(k, defaults[k]) for k, v in given.items()}
    return budget_config(budget, tokens, variant, **sizes, device_codes=not _on_cpu(model), **overrides)


def _on_cpu(model: Any) -> bool:
    """True for a torch model whose weights sit on the CPU (a config or a name: unknown, False).
    Measured on the tiny model at 32K and 1/8 (docs/measurements.md, "Re-rank codes on a CPU"):
    decode 2.59x DynamicCache with exact keys scored in place, 1.18x with codes held "on the device"."""
    params = getattr(model, "parameters", None)
    if not callable(params):
        return False
    try:
        first = next(iter(params()), None)
    except TypeError:
        return False
    return first is not None and getattr(first, "device", None) is not None and first.device.type == "cpu"


set_budget_solver(for_budget)  # FlashMemoryConfig.for_budget calls it (no import from config to here)
