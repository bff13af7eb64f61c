"""The names of the cache's tiers, in one place (torch-free, so `flashmem estimate` can
import them without torch).

What a managed layer keeps on the device (`FlashLayer.resident_bytes()`), what the
cache reports (`FlashMemoryCache.memory_report()["tiers"]`) and what the calculator
predicts (`flashmem estimate`) are keyed by these names, so a measured report and a
predicted one line up row by row, and a new tier is added here once.
"""

from __future__ import annotations

# The device tiers of one managed (FlashMemory) layer, in report order.
LAYER_TIERS: tuple[str, ...] = (
    "sinks",  # the first tokens, exact
    "window",  # the recent tokens, exact
    "open_block",  # the block being filled, exact
    "csa_entries",  # compressed summaries (CSA), when enabled
    "hca_entries",  # heavily compressed summaries (HCA), when enabled
    "index",  # the per-block keys the ranking reads
    "working_set",  # pages selected for this step, held on the device
    "query_buffer",  # the fusion rule's last queries (summaries' scoring)
    "rest_entry",  # running sum of sealed values: the rest entry (mean of the left-out tokens)
    "prefill_kv",  # the exact prompt's K/V during prefill (0 from the first generated token)
)

# Layers the cache keeps whole, outside the managed tiers.
WHOLE_LAYERS: tuple[str, ...] = (
    "full_layers",  # managed-eligible layers kept full (keep_full_layers)
    "sliding_layers",  # the model's own sliding-window layers
    "native_compressed_layers",  # layers the model compresses itself (e.g. DeepSeek-V4)
)

# Every row of a device-memory breakdown, measured or predicted.
TIERS: tuple[str, ...] = LAYER_TIERS + WHOLE_LAYERS


def zeros(names: tuple[str, ...] = TIERS) -> dict[str, int]:
    """{name: 0} for `names`, in their order: the start of a per-tier byte count."""
    return dict.fromkeys(names, 0)
