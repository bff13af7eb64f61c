"""The calculator against the bytes of real cache tensors (tiny random models).

Each test builds a tiny random-weight model with transformers 5.24, runs a
forward of N tokens into a `DynamicCache(config=...)`, sums the bytes of the
tensors the cache holds, and compares with `estimate(config_object, ...)`.

What is counted: the logical size (numel x element size) of every floating
tensor the cache layers hold, each tensor object once (DeepSeek-V4 compressed
layers alias `values` to `keys`). Storage kept alive behind a view (HF's sliding
layer slices the concatenated tensor) is not counted: it is freed on the next
update.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from flashmem.sizing.calculator import estimate  # noqa: E402
from flashmem.sizing.specs import resolve_model  # noqa: E402


def _tensors(obj):
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            yield from (t for t in v.values() if isinstance(t, torch.Tensor))


def cache_bytes(cache, names=None) -> int:
    """Bytes of the floating tensors of every cache layer, each tensor object once."""
    seen: set[int] = set()
    total = 0
    for layer in cache.layers:
        for t in _tensors(layer):
            if id(t) in seen or not t.is_floating_point():
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _forward(model, cfg, tokens: int, batch: int = 1, steps: int = 0):
    torch.manual_seed(0)
    cache = DynamicCache(config=cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        for _ in range(steps):  # decode steps, one token each
            model(torch.randint(0, cfg.vocab_size, (batch, 1)), cache=cache, use_cache=True)
    return cache


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tokens,batch,steps", [(37, 1, 0), (20, 2, 3)])
def test_llama_gqa_matches_dynamic_cache(llama, tokens, batch, steps):
    cfg, model = llama
    cache = _forward(model, cfg, tokens, batch, steps)
    est = estimate(cfg, tokens=tokens + steps, batch=batch, dtype="float32")
    assert est.full_cache_bytes == cache_bytes(cache)
    # 3 layers x 2 KV heads x 16 dims x (K + V) x 4 bytes
    assert est.bytes_per_token == 3 * 2 * 16 * 2 * 4


def test_llama_from_config_json_folder(llama, tmp_path):
    cfg, model = llama
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    cache = _forward(model, cfg, 25)
    est = estimate(str(tmp_path), tokens=25, dtype="float32")
    assert est.full_cache_bytes == cache_bytes(cache)


def test_gemma3_sliding_and_global_layers():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=128,
        sliding_window=8,
    )
    # transformers' default pattern: 5 sliding : 1 full
    assert cfg.layer_types.count("sliding_attention") == 5
    spec = resolve_model(cfg)
    assert [l.kind for l in spec.layers] == ["sliding"] * 5 + ["full"]
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    for tokens, steps in ((5, 0), (30, 0), (30, 4)):
        cache = _forward(model, cfg, tokens, steps=steps)
        est = estimate(cfg, tokens=tokens + steps, dtype="float32")
        assert est.full_cache_bytes == cache_bytes(cache), (tokens, steps)
    # at long context only the global layer grows
    assert est.bytes_per_token == 1 * 16 * 2 * 4
    assert est.fixed_bytes == 5 * 7 * 16 * 2 * 4  # HF keeps window - 1 tokens


def _tiny_mla(cls_name: str, **extra):
    cfg_cls = getattr(transformers, cls_name + "Config")
    model_cls = getattr(transformers, cls_name + "ForCausalLM")
    cfg = cfg_cls(
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        vocab_size=128,
        **extra,
    )
    torch.manual_seed(0)
    return cfg, model_cls(cfg).eval()


def test_deepseek_v3_mla_stores_latents():
    # transformers 5.24's DeepseekV3Attention caches the compressed latent
    # (kv_lora_rank) and the shared rotary key (qk_rope_head_dim), not the
    # decompressed per-head K/V: the MLA term is exactly what it stores.
    cfg, model = _tiny_mla("DeepseekV3")
    cache = _forward(model, cfg, 33, steps=2)
    est = estimate(cfg, tokens=35, dtype="float32")
    assert est.bytes_per_token == 2 * (16 + 8) * 4
    assert est.full_cache_bytes == cache_bytes(cache)


def test_deepseek_v32_mla_plus_indexer():
    cfg, model = _tiny_mla("DeepseekV32", index_head_dim=16, index_n_heads=2, index_topk=8)
    cache = _forward(model, cfg, 33)
    est = estimate(cfg, tokens=33, dtype="float32")
    assert est.bytes_per_token == 2 * (16 + 8 + 16) * 4
    assert est.full_cache_bytes == cache_bytes(cache)


def test_deepseek_v4_sliding_csa_hca():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=8,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    )
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval()
    spec = resolve_model(cfg)
    assert [l.kind for l in spec.layers] == ["sliding", "v4_csa", "v4_hca"]
    for tokens in (41, 64):
        cache = _forward(model, cfg, tokens)
        est = estimate(cfg, tokens=tokens, dtype="float32")
        # what the calculator counts, read from the cache's named tensors
        sw, csa, hca = cache.layers
        counted = (
            sw.keys.numel() * 4  # K = V in V4: one copy (see below)
            + csa.keys.numel() * 4
            + csa.compressed_kv["compressor"].numel() * 4
            + csa.compressed_kv["indexer"].numel() * 4
            + hca.keys.numel() * 4
            + hca.compressed_kv["compressor"].numel() * 4
        )
        assert est.full_cache_bytes == counted
        assert csa.compressed_kv["compressor"].shape[1] == tokens // 4
        assert hca.compressed_kv["compressor"].shape[1] == tokens // 16
        assert csa.values is csa.keys and hca.values is hca.keys
        # Known difference, documented: the sliding-only layer goes through HF's
        # generic DynamicSlidingWindowLayer, which stores the identical K and V as
        # two tensors; the calculator counts K=V once, as the model needs.
        assert torch.equal(sw.keys, sw.values) and sw.values.data_ptr() != sw.keys.data_ptr()
        duplicate_v = sw.values.numel() * 4
        # Not counted: compressor scratch (a partial window of < compress_rate
        # projected tokens, CSA overlap slices): bounded, does not grow with T.
        scratch = cache_bytes(cache) - counted - duplicate_v
        assert 0 <= scratch <= 4 * (4 * 2 * (32 + 16) * 2) + 16 * 32 * 2 * 4 * 2


@pytest.mark.parametrize("ws_codec", ["model", "int8"])
def test_flashmem_cache_memory_report_agrees_with_estimate(llama, ws_codec):
    """The cache's measured memory_report and the calculator share tiers.py: the
    per-tier bytes agree exactly (an int8 working set too); the total within 5% (the
    cache also keeps a small buffer of recent queries that the calculator does not count)."""
    try:
        import flashmem
        from flashmem.config import FlashMemoryConfig

        attach = flashmem.attach
    except Exception as exc:  # the cache is another module's work
        pytest.skip(f"flashmem.attach not importable: {exc}")
    cfg, model = llama
    fc = FlashMemoryConfig(
        sink_tokens=4,
        gpu_cache_limit=64,
        hca_chunk_size=16,
        csa_chunk_size=4,
        csa_band_tokens=32,
        lsa_top_k=2,
        prefill_chunk=64,
        keep_full_layers=[-1],
        prefetch_threads=0,
        working_set_codec=ws_codec,
    )
    cache = attach(model, fc)
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 300)), cache=cache, use_cache=True)
            for _ in range(3):
                model(torch.randint(0, 128, (1, 1)), cache=cache, use_cache=True)
        rep = cache.memory_report()
    finally:
        cache.close()
        model.set_attn_implementation("sdpa")
    est = estimate(cfg, tokens=303, config=fc, dtype="float32").flashmem
    for tier in ("sinks", "window", "open_block", "csa_entries", "hca_entries", "index", "working_set"):
        assert rep["tiers"][tier] == est.tiers[tier], tier
    assert rep["full_layer_bytes"] == est.tiers["full_layers"]
    assert rep["cold_bytes"] == est.cold_bytes
    assert abs(rep["device_resident_bytes"] / est.device_resident_bytes - 1) < 0.05
