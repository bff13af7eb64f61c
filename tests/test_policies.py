"""The torch-free registries (flashmem.policies) agree with the classes they name,
and the commands that read only them stay free of torch."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
import torch

from flashmem import policies
from flashmem.config import FlashMemoryConfig
from flashmem.errors import ConfigError
from flashmem.index import make_scorer
from flashmem.index.base import ScorerContext
from flashmem.sizing.tiers import index_bytes, tier_counts
from flashmem.store.codecs import CODECS


@pytest.mark.parametrize("name", sorted(policies.SCORERS))
def test_scorer_declares_the_summary_width_it_produces(name):
    spec = policies.SCORERS[name]
    if spec.needs_calibration:  # per-token low-rank keys: 8-token pages, rank 16 of a 16-dim head
        cfg = FlashMemoryConfig(hca_chunk_size=8, csa_chunk_size=4)
        cal = {n: torch.randn(2, 16, 16) for n in ("key_basis", "query_proj", "key_proj")}
        scorer = make_scorer(name, ScorerContext(layer_idx=0, kv_heads=2, head_dim=16, cfg=cfg, calibration=cal))
        summary = scorer.summarize(torch.randn(1, 2, 8, 16), torch.ones(1, 8, dtype=torch.bool))
        assert summary.shape == (1, 2, 8, 16)
        assert spec.index_bytes(cfg, 16, 2).per_token * 8 == summary[0, 0].numel() * 2
        return
    cfg = FlashMemoryConfig()
    scorer = make_scorer(name, ScorerContext(layer_idx=0, kv_heads=2, head_dim=16, cfg=cfg))
    assert scorer.name == name and scorer.vectors == spec.vectors
    summary = scorer.summarize(torch.randn(1, 2, 8, 16), torch.ones(1, 8, dtype=torch.bool))
    assert summary.shape == (1, 2, spec.vectors, 16)
    assert spec.index_bytes(cfg, 16, 2).per_block == summary[0, 0].numel() * 2


@pytest.mark.parametrize("name", sorted(policies.CODECS))
def test_codec_declares_the_bytes_it_writes(name):
    k = torch.randn(1, 2, 64, 32, dtype=torch.bfloat16)
    payload = CODECS[name].encode(k, k)
    assert CODECS[name].name == name
    assert payload.numel() == policies.CODECS[name].bytes_per_element(2) * 2 * k.numel()


@pytest.mark.parametrize(
    "registry,field",
    [
        (policies.SCORERS, "lsa_scorer"),
        (policies.FUSION_RULES, "fusion_rule"),
        (policies.CODECS, "cold_codec"),
        (policies.COLD_STORES, "cold_store"),
    ],
)
def test_config_accepts_exactly_the_registered_names(registry, field):
    assert typing.get_args(FlashMemoryConfig.model_fields[field].annotation) == tuple(registry)
    with pytest.raises(ConfigError, match=f"{field}: 'nope' is not allowed"):
        FlashMemoryConfig(**{field: "nope"})


def test_index_bytes_has_a_per_token_part():
    # a scorer with a per-token index (e.g. low-rank keys) is sized by tokens, not blocks
    cfg = FlashMemoryConfig(gpu_cache_limit=64, hca_chunk_size=32, csa_band_tokens=0, sink_tokens=0)
    counts = tier_counts(cfg, 64 + 32 * 10)
    spec = policies.SCORERS["quest"]
    fake = policies.ScorerSpec("x", spec.impl, 0, lambda c, d, eb: policies.IndexBytes(per_block=4, per_token=3))
    policies.SCORERS["x"] = fake
    try:
        assert index_bytes(cfg.model_copy(update={"lsa_scorer": "x"}), counts, 16, 2) == 10 * 4 + 320 * 3
    finally:
        del policies.SCORERS["x"]


def test_estimate_and_config_check_do_not_import_torch(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("flash_memory:\n  lsa_scorer: mean_key\n  cold_codec: int4\n")
    code = (
        "import sys\n"
        "from flashmem.cli.main import main\n"
        f"for argv in (['estimate', '--model', 'llama-3.1-8b', '--tokens', '8k', '--config', {str(cfg)!r}],"
        f" ['config', 'check', {str(cfg)!r}]):\n"
        "    sys.argv = ['flashmem', *argv]\n"
        "    try:\n        main()\n    except SystemExit as e:\n        assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
