"""`flashmem.attach(model)`: register the attention function, build the cache (the
recipe at a budget unless a config is given)."""

from __future__ import annotations

from typing import Any

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flashmem import policies
from flashmem.cache import attention, generation
from flashmem.cache.flash_cache import FlashMemoryCache
from flashmem.config import FlashMemoryConfig
from flashmem.errors import FlashMemError
from flashmem.models import geometry
from flashmem.recipe import DEFAULT_BUDGET, default_tokens
from flashmem.rope import RopeRotator, find_rotator


def register() -> None:
    """Make 'tiered_kv' (attention.NAME) a valid attn_implementation and "flashmem" a valid
    generate(cache_implementation=...) (cache/generation.py) (idempotent).

    Masks are SDPA's boolean masks: unmanaged layers use them as is, managed
    layers read padding from them.
    """
    AttentionInterface.register(attention.NAME, attention.flashmem_attention)
    AttentionMaskInterface.register(attention.NAME, sdpa_mask)
    generation.register_cache_implementation()  # generate(cache_implementation="flashmem")


def attach(
    model: PreTrainedModel,
    cfg: FlashMemoryConfig | None = None,
    *,
    budget: float | None = None,
    tokens: int | None = None,
    tokenizer: Any = None,
    **overrides: Any,
) -> FlashMemoryCache:
    """Switch `model` to flashmem attention and return a fresh cache for one batch.

    Without `cfg` the cache is the recipe (`flashmem.recipe`): the device holds about
    `budget` (default 1/8) x the full cache's KV bytes after a prompt of `tokens`
    tokens (default: 8,192, or the model's context when shorter), through the prompt
    too (it is read back from the tiers); a longer prompt holds less, a shorter one more (it is
    `FlashMemoryConfig.for_budget(budget, tokens, model)`). With `cfg` that config is
    used as given (`budget` / `tokens` are then refused). `overrides`: config keys laid
    over either.

    Pass the cache to `model.generate(..., cache=cache)` or to manual forwards
    (`model(input_ids, cache=cache, use_cache=True)`). Layers that the cache
    does not manage run plain SDPA attention, so the model keeps working with
    other caches too. A scorer that needs a calibration (`lowrank`, `learned`), and
    `cold_low_rank`, read `cfg.calibration`, else the one cached for this model by
    `flashmem calibrate`; with `tokenizer` given, a missing one is built once
    and cached (`flashmem.calibration.cached_calibration`). `lsa_layer_shares:
    profile` (the recipe's) reads the model's layer profile, or measures it once with
    `tokenizer` (or the one `flashmem.load_model` returned with the model).
    """
    from flashmem.cache.support import check_model

    check_model(model)  # one line for what the cache cannot serve (cache/support.py)
    text_cfg = model.config.get_text_config(decoder=True)
    cfg = _config_for(model, text_cfg, cfg, budget, tokens, overrides)
    cfg.check_for_model(text_cfg.num_hidden_layers)
    register()
    if model.config._attn_implementation != attention.NAME:
        model.set_attn_implementation(attention.NAME)
    if cfg.exact_on_doubt:
        from flashmem.cache import doubt

        doubt.install(model)  # near-tie steps run again exactly (cache/doubt.py)
    head_dim = geometry.head_dim(text_cfg) or 0
    kinds = set(geometry.layer_types(text_cfg, text_cfg.num_hidden_layers, infer_sliding=False))
    rotators: dict[str | None, RopeRotator | None] = {kind: find_rotator(model, kind, head_dim) for kind in kinds}
    calibration = _calibration_for(model, cfg, tokenizer)
    if cfg.lsa_layer_shares == "profile":
        from flashmem.calibration.layer_profile import resolve_profile_shares

        cfg = resolve_profile_shares(cfg, model, tokenizer)
    return FlashMemoryCache(
        model.config, cfg, rotators=rotators, dtype=model.dtype, calibration=calibration, device=_device_type(model)
    )


def _config_for(
    model: PreTrainedModel,
    text_cfg: Any,
    cfg: FlashMemoryConfig | None,
    budget: float | None,
    tokens: int | None,
    overrides: dict[str, Any],
) -> FlashMemoryConfig:
    """`cfg` with the overrides laid over it, or the recipe at `budget` after `tokens` (see `attach`)."""
    if cfg is None:
        size = default_tokens(text_cfg) if tokens is None else tokens
        if "prefill_chunk" not in overrides and _device_type(model) not in ("cpu", "meta"):
            # On an accelerator the streamed prompt is link-bound in 512-token chunks (Llama-3.1-8B
            # at 128K on an H200, modelled: 39.5 s against 13.4 s of compute) and compute-bound in
            # 4,096-token ones (docs/accelerator.md); the transients stay bounded either way.
            overrides = {**overrides, "prefill_chunk": ACCELERATOR_PREFILL_CHUNK}
        cfg = FlashMemoryConfig.for_budget(DEFAULT_BUDGET if budget is None else budget, size, model, **overrides)
        if overrides:  # keys the solver sizes (window, pages) stay as the caller set them
            cfg = FlashMemoryConfig(**{**cfg.model_dump(), **overrides})
    elif not isinstance(cfg, FlashMemoryConfig):
        raise FlashMemError(
            f"cfg: a {type(cfg).__name__} is not allowed; allowed: a FlashMemoryConfig "
            "(FlashMemoryConfig.from_yaml(path), FlashMemoryConfig.for_budget(...)), or none for the recipe"
        )
    elif budget is not None or tokens is not None:
        raise FlashMemError(
            "budget / tokens size the recipe when no config is given; allowed: attach(model, budget=..., "
            "tokens=...) or attach(model, cfg), not both"
        )
    elif overrides:
        cfg = FlashMemoryConfig(**{**cfg.model_dump(), **overrides})
    return cfg


# The recipe's prompt chunk on an accelerator (on a CPU the recipe's 512 holds).
ACCELERATOR_PREFILL_CHUNK = 4096


def _device_type(model: PreTrainedModel) -> str:
    """Where the model's weights are: "cpu", "cuda", ... ("cpu" for a model without parameters)."""
    p = next(iter(model.parameters()), None)
    return "cpu" if p is None else p.device.type


def _calibration_for(model: PreTrainedModel, cfg: FlashMemoryConfig, tokenizer: Any) -> Any | None:
    """The calibration the scorer or cold_low_rank needs: cfg.calibration, else this model's
    cached one (built once with `tokenizer`); None when nothing needs one."""
    if not (policies.SCORERS[cfg.lsa_scorer].needs_calibration or cfg.cold_low_rank != "none"):
        return None
    from flashmem.calibration import cached_calibration, load_calibration

    if cfg.calibration is not None:
        calibration = load_calibration(cfg.calibration)
        calibration.check_model(model)
        return calibration
    return cached_calibration(model, tokenizer)
