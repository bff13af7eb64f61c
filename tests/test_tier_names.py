"""One list of tier names (issue 28): what a layer measures, what the cache reports
and what the calculator predicts use `flashmem.tier_names`."""

from __future__ import annotations

import subprocess
import sys

import torch

import flashmem
from flashmem import tier_names
from flashmem.cache.flash_layer import FlashLayer
from test_cache import SMALL
from tiny_models import tiny_llama


def test_the_list_has_no_repeats_and_imports_without_torch():
    assert len(set(tier_names.TIERS)) == len(tier_names.TIERS)
    assert tier_names.TIERS[: len(tier_names.LAYER_TIERS)] == tier_names.LAYER_TIERS
    assert list(tier_names.zeros(("a", "b"))) == ["a", "b"]
    code = (
        "import sys, importlib.util as u\n"
        "s = u.spec_from_file_location('t', sys.argv[1]); s.loader.exec_module(u.module_from_spec(s))\n"
        "print('torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code, tier_names.__file__], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "False", p.stderr


def test_a_layer_measures_and_the_cache_reports_exactly_the_layer_tiers():
    model = tiny_llama()
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**SMALL))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0)), cache=cache, use_cache=True)
    layer = next(x for x in cache.layers if isinstance(x, FlashLayer))
    assert set(layer.resident_bytes()) == set(tier_names.LAYER_TIERS)
    assert tuple(cache.memory_report()["tiers"]) == tier_names.LAYER_TIERS


def test_the_calculator_predicts_every_tier_by_the_same_names():
    from flashmem.sizing.calculator import estimate

    est = estimate("smollm2", tokens=8192, config=flashmem.FlashMemoryConfig.for_budget(1 / 8, 8192, "smollm2"))
    assert est.flashmem is not None and tuple(est.flashmem.tiers) == tier_names.TIERS
