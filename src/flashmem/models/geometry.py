"""Model geometry: layer kinds, KV heads, head dim, the sliding/global layout.

One reading of a model's shape facts, shared by the calculator
(`sizing/specs.py`), the loader and registry (`models/`) and the cache. Works
on a transformers `PretrainedConfig` or its dict (config.json); torch-free.
"""

from __future__ import annotations

from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
# Layer kinds whose cache transformers bounds itself (a window of recent tokens).
WINDOWED_KINDS = (SLIDING, CHUNKED)

# Gemma3: every 6th layer is global (layer i is full when (i + 1) % 6 == 0), the
# rest slide; transformers' Gemma3TextConfig default, and what it and llama.cpp
# build for a GGUF Gemma3, whose metadata has no layer pattern.
GEMMA3_GLOBAL_EVERY = 6


def get(cfg: Any, key: str, default: Any = None) -> Any:
    """cfg[key] or cfg.key; `default` when absent or None."""
    v = cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    return default if v is None else v


def gemma3_layer_types(n: int, every: int = GEMMA3_GLOBAL_EVERY) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(n))


def kv_heads(cfg: Any) -> int | None:
    """KV heads per layer (num_key_value_heads, else num_attention_heads / n_head)."""
    v = get(cfg, "num_key_value_heads") or get(cfg, "num_attention_heads") or get(cfg, "n_head")
    return int(v) if v else None


def head_dim(cfg: Any) -> int | None:
    """head_dim, else hidden_size // num_attention_heads."""
    hd = get(cfg, "head_dim")
    if hd:
        return int(hd)
    hidden, heads = get(cfg, "hidden_size"), get(cfg, "num_attention_heads") or get(cfg, "n_head")
    return int(hidden) // int(heads) if hidden and heads else None


def layer_types(cfg: Any, n: int, *, infer_sliding: bool = True) -> tuple[str, ...]:
    """Kind of each of the n layers: the config's `layer_types`, else all sliding
    when it has a sliding window in use (`use_sliding_window`, default true) and
    infer_sliding, else full. (The cache passes infer_sliding=False: it manages
    every layer the config does not declare sliding.)"""
    types = get(cfg, "layer_types")
    if types:
        return tuple(types)
    sliding = infer_sliding and get(cfg, "sliding_window") is not None and get(cfg, "use_sliding_window", True)
    return (SLIDING if sliding else FULL,) * n


def keeps_window(kind: str, cfg: Any) -> bool:
    """Whether transformers keeps a layer of this kind as a bounded window cache."""
    return kind in WINDOWED_KINDS and bool(get(cfg, "sliding_window"))
