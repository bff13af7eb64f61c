"""Baselines measured side by side with flashmem (docs/design.md, "Peers").

Method names used by the benchmark harness:

* ``full``: plain `DynamicCache` (the quality ceiling, the speed/memory baseline);
* ``streaming``: StreamingLLM, sinks + recent window (:mod:`.streaming`);
* ``snapkv``: SnapKV post-prefill eviction (:mod:`.snapkv`);
* ``kvpress:<Press>``: NVIDIA kvpress 0.5.5 presses, run in their own venv (:mod:`.kvpress_env`; the runner file must not sit beside a module named kvpress);
* ``flashmem`` / ``flashmem:<variant>``: the FlashMemory cache (:mod:`.flashmem_adapter`);
* ``quanto-int4|int2``, ``hqq-int4|int2``, ``kivi-int4|int2``: quantized caches, every token kept
  (:mod:`.quantized`); built after the full prefill like the eviction baselines, they ignore the
  budget (rows report the measured ratio beside the nominal budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashmem.errors import FlashMemError

KVPRESS_PRESSES = ("SnapKVPress", "ExpectedAttentionPress", "TOVAPress", "KeyDiffPress")


@dataclass(frozen=True)
class Method:
    name: str  # as given: "full", "snapkv", "kvpress:SnapKVPress", "flashmem:raw"
    kind: str  # "full" | "eviction" | "kvpress" | "flashmem"
    variant: str = ""

    @property
    def budgeted(self) -> bool:
        return self.kind != "full"


def parse_method(name: str) -> Method:
    name = name.strip()
    if name == "full":
        return Method(name, "full")
    if name in ("streaming", "snapkv"):
        return Method(name, "eviction", name)
    from flashmem_eval.baselines.quantized import QUANT_METHODS

    if name in QUANT_METHODS:
        return Method(name, "eviction", name)
    if name.startswith("kvpress:"):
        press = name.split(":", 1)[1]
        if press not in KVPRESS_PRESSES:
            raise FlashMemError(f"method: {name!r} is not known; allowed presses: {', '.join(KVPRESS_PRESSES)}")
        return Method(name, "kvpress", press)
    if name == "flashmem" or name.startswith("flashmem:"):
        variant = name.split(":", 1)[1] if ":" in name else "default"
        from flashmem_eval.baselines.flashmem_adapter import VARIANTS

        if variant not in VARIANTS:
            raise FlashMemError(f"method: {name!r} is not known; allowed flashmem variants: {', '.join(VARIANTS)}")
        return Method(name, "flashmem", variant)
    raise FlashMemError(
        f"method: {name!r} is not known; allowed: full, streaming, snapkv, flashmem[:variant], "
        f"kvpress:<{'|'.join(KVPRESS_PRESSES)}>, {', '.join(QUANT_METHODS)}"
    )
