"""`flashmem.attach(model, cfg)`: register the attention function, build the cache."""

from __future__ import annotations

from typing import Any

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flashmem import policies
from flashmem.cache import attention
from flashmem.cache.flash_cache import FlashMemoryCache
from flashmem.config import FlashMemoryConfig
from flashmem.models import geometry
from flashmem.rope import RopeRotator, find_rotator


def register() -> None:
    """Make 'tiered_kv' (attention.NAME) a valid attn_implementation (idempotent).

    Masks are SDPA's boolean masks: unmanaged layers use them as is, managed
    layers read padding from them.
    """
    AttentionInterface.register(attention.NAME, attention.flashmem_attention)
    AttentionMaskInterface.register(attention.NAME, sdpa_mask)


def attach(
    model: PreTrainedModel, cfg: FlashMemoryConfig | None = None, *, tokenizer: Any = None, **overrides: Any
) -> FlashMemoryCache:
    """Switch `model` to flashmem attention and return a fresh cache for one batch.

    Pass the cache to `model.generate(..., cache=cache)` or to manual forwards
    (`model(input_ids, cache=cache, use_cache=True)`). Layers that the cache
    does not manage run plain SDPA attention, so the model keeps working with
    other caches too. A scorer that needs a calibration (`lowrank`, `learned`), and
    `cold_low_rank`, read `cfg.calibration`, else the one cached for this model by
    `flashmem calibrate`; with `tokenizer` given, a missing one is built once
    and cached (`flashmem.calibration.cached_calibration`). `lsa_layer_shares:
    profile` reads the model's layer profile, or measures it once with `tokenizer`
    (or the one `flashmem.load_model` returned with the model).
    """
    cfg = cfg if cfg is not None else FlashMemoryConfig()
    if overrides:
        cfg = FlashMemoryConfig(**{**cfg.model_dump(), **overrides})
    text_cfg = model.config.get_text_config(decoder=True)
    cfg.check_for_model(text_cfg.num_hidden_layers)
    register()
    if model.config._attn_implementation != attention.NAME:
        model.set_attn_implementation(attention.NAME)
    head_dim = geometry.head_dim(text_cfg) or 0
    kinds = set(geometry.layer_types(text_cfg, text_cfg.num_hidden_layers, infer_sliding=False))
    rotators: dict[str | None, RopeRotator | None] = {kind: find_rotator(model, kind, head_dim) for kind in kinds}
    calibration = None
    if policies.SCORERS[cfg.lsa_scorer].needs_calibration or cfg.cold_low_rank != "none":
        from flashmem.calibration import cached_calibration, load_calibration

        if cfg.calibration is not None:
            calibration = load_calibration(cfg.calibration)
            calibration.check_model(model)
        else:
            calibration = cached_calibration(model, tokenizer)
    if cfg.lsa_layer_shares == "profile":
        from flashmem.calibration.layer_profile import resolve_profile_shares

        cfg = resolve_profile_shares(cfg, model, tokenizer)
    return FlashMemoryCache(model.config, cfg, rotators=rotators, dtype=model.dtype, calibration=calibration)
