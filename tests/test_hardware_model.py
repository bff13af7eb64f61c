"""The hardware model (flashmem.sizing.hardware): its arithmetic against figures worked
out by hand here, for Llama-3.1-8B at 128K tokens on an H200. Modelled, not measured."""

from __future__ import annotations

import json
import math

import pytest

from flashmem.config import FlashMemoryConfig
from flashmem.errors import ConfigError
from flashmem.sizing import hardware as hwm
from flashmem.sizing.calculator import estimate

# By hand: Llama-3.1-8B, 32 layers x 8 KV heads x 128 dims x (K + V) x 2 bytes (bf16)
KV_TOKEN = 32 * 8 * 128 * 2 * 2  # 131,072 B
TOKENS = 131072
KV_SEQ = KV_TOKEN * TOKENS  # 16 GiB
# parameters: embeddings + head 2 x 128256 x 4096; per layer q 4096^2, k/v 2 x 4096 x 1024,
# o 4096^2, MLP 3 x 4096 x 14336, two norms 2 x 4096; the final norm 4096
PARAMS = 2 * 128256 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096
WEIGHTS = PARAMS * 2
HBM = 143771 * 2**20  # nvidia-smi's H200 total
BW = 4.8e12
LINK = 55e9
ALLOW = 2 * 2**30


@pytest.fixture
def h200() -> tuple[hwm.Hardware, hwm.ModelCost, hwm.Assumptions]:
    cost = hwm.model_cost("llama-3.1-8b", layers=32, kv_bytes_per_token=KV_TOKEN, dtype_bytes=2, q_width=0)
    return hwm.get_hardware("h200"), cost, hwm.Assumptions(dispatch="off")


def test_the_model_knows_llama_8b_as_published(h200):
    _, cost, _ = h200
    assert PARAMS == 8_030_261_248  # the published count
    assert cost.params == PARAMS and cost.weight_bytes == WEIGHTS
    assert cost.q_width == 32 * 128  # from the built-in's dimensions, not the argument
    assert KV_SEQ == 16 * 2**30
    # the other built-ins' published counts
    assert hwm.ARCHS["smollm2"].params == 134_515_008
    assert hwm.ARCHS["gemma3-270m"].params == 268_098_176
    assert hwm.ARCHS["qwen2.5-7b"].params == 7_615_616_512
    assert hwm.ARCHS["llama-3.1-70b"].params == 70_553_706_496


def test_full_cache_in_hbm(h200):
    hw, cost, a = h200
    row = hwm.full_row(hw, cost, TOKENS, 1, a)
    assert row.largest_batch == math.floor((HBM - WEIGHTS - ALLOW) / KV_SEQ) == 7
    assert row.step_s == pytest.approx((WEIGHTS + KV_SEQ) / BW)  # ~6.9 ms
    assert row.bound == "HBM"
    assert row.step_s_at_largest == pytest.approx((WEIGHTS + 7 * KV_SEQ) / BW)
    assert row.tokens_per_s_at_largest == pytest.approx(7 / ((WEIGHTS + 7 * KV_SEQ) / BW))
    # prefill: 2 x params x N + causal attention 2 x layers x q_width x N (N + 1), at half of 989 TFLOPS
    flops = 2 * PARAMS * TOKENS + 2 * 32 * 4096 * TOKENS * (TOKENS + 1)
    assert row.prefill_s == pytest.approx(flops / (0.5 * 989e12)) and row.prefill_bound == "compute"
    # DynamicCache's torch.cat reads and writes the cache once more per step
    dyn = hwm.full_row(hw, cost, TOKENS, 1, a, kv_passes=3)
    assert dyn.step_s == pytest.approx((WEIGHTS + 3 * KV_SEQ) / BW)


def test_offloaded_streams_every_layer_over_the_link(h200):
    hw, cost, a = h200
    row = hwm.offloaded_row(hw, cost, TOKENS, 1, a, None)
    assert row.device_bytes_per_seq == 2 * KV_SEQ / 32  # two layers resident
    assert row.largest_batch == math.floor((HBM - WEIGHTS - ALLOW) / (2 * KV_SEQ / 32)) == 123
    assert row.step_s == pytest.approx(KV_SEQ / LINK) and row.bound == "link"  # ~312 ms
    assert row.link_bytes_per_step == KV_SEQ
    # host memory bounds it when given: 100 GiB holds 6 caches of 16 GiB
    assert hwm.offloaded_row(hw, cost, TOKENS, 1, a, 100 * 2**30).largest_batch == 6
    # without overlap the step is the sum of its parts
    serial = hwm.offloaded_row(hw, cost, TOKENS, 1, hwm.Assumptions(dispatch="off", overlap=False), None)
    flops = 2 * PARAMS + 4 * 32 * 4096 * TOKENS
    assert serial.step_s == pytest.approx(KV_SEQ / LINK + (WEIGHTS + KV_SEQ) / BW + flops / (0.5 * 989e12))


def synthetic_report(step_read: int, step_h2d: int, chunk_h2d: int, chunks: int) -> dict:
    zero = {k: 0 for k in hwm.TRAFFIC_KEYS}
    return {
        "steps": {"prefill_chunks": chunks, "decode_steps": 16},
        "totals": dict(zero, h2d_bytes=chunk_h2d * chunks + 16 * step_h2d),
        "per_decode_step_median": dict(zero, device_read_bytes=step_read, h2d_bytes=step_h2d),
        "per_prefill_chunk_median": dict(zero, h2d_bytes=chunk_h2d),
        "full_cache_bytes": KV_SEQ,
        "layers": 32,
    }


def test_flashmem_row_from_a_counted_traffic_report(h200):
    hw, cost, a = h200
    resident, step_read, step_h2d = 2**30, 10**9, 50 * 10**6
    report = synthetic_report(step_read, step_h2d, 10**8, 256)
    hwm.check_traffic(report)
    tr = hwm.counted_traffic(report, resident, 0, "synthetic")
    row = hwm.flashmem_row(hw, cost, TOKENS, 1, a, tr, KV_SEQ, None)
    assert row.largest_batch == math.floor((HBM - WEIGHTS - ALLOW) / resident) == 123
    assert row.step_s == pytest.approx((WEIGHTS + step_read) / BW) and row.bound == "HBM"  # 3.55 ms > 0.9 ms link
    assert row.step_s_at_largest == pytest.approx(123 * step_h2d / LINK)  # 112 ms: the link binds
    assert row.bound_at_largest == "link"
    assert row.tokens_per_s_at_largest == pytest.approx(LINK / step_h2d)  # 1100 tok/s
    assert row.prefill_link_bytes == 256 * 10**8
    # issue 27's targets, by hand
    full1 = hwm.full_row(hw, cost, TOKENS, 1, a)
    tg = hwm.targets(hw, cost, a, full1, row, tr)
    full_tps = 7 / ((WEIGHTS + 7 * KV_SEQ) / BW)
    assert tg["throughput_ratio_at_largest_batch"] == pytest.approx((LINK / step_h2d) / full_tps)
    assert tg["throughput_target_met"]  # ~4.5x
    assert tg["batch1_speed_ratio"] == pytest.approx(((WEIGHTS + KV_SEQ) / BW) / ((WEIGHTS + step_read) / BW))
    assert tg["batch1_target_met"]
    # the link budget for 3x: the step may take 123 / (3 x full tok/s); the link carries 123 x x in it
    assert tg["link_bytes_per_seq_step_for_target"] == pytest.approx(123 / (3 * full_tps) * LINK / 123)
    # a report with more link bytes per step than that misses the target
    slow = hwm.counted_traffic(synthetic_report(step_read, 10**8, 0, 0), resident, 0, "slow")
    slow_row = hwm.flashmem_row(hw, cost, TOKENS, 1, a, slow, KV_SEQ, None)
    assert not hwm.targets(hw, cost, a, full1, slow_row, slow)["throughput_target_met"]


def test_flashmem_row_predicted_from_the_recipe(h200):
    """The recipe at 1/16 and 128K (issue 27): 4,096 selected tokens per layer, 1,024 re-rank
    candidate pages of 16 tokens whose keys (half of K+V) come over the link: 1 GiB (a disk
    tier, or --rerank-keys link); with a memory cold tier (the default) they are read on the
    host and only the new pages cross."""
    hw, cost, _ = h200
    recipe = FlashMemoryConfig.for_budget(1 / 16, TOKENS, group=4, head_dim=128, dtype_bytes=2)
    # the recipe holds int4 candidate codes on the device here (recipe.DEVICE_RERANK: tested in
    # test_rerank_codes_held_on_the_device); this test models its exact re-rank
    assert recipe.lsa_rerank_codec == "int4" and recipe.lsa_rerank_on_device
    # (and its page cache: test_page_cache_is_held_but_not_read_by_a_step)
    cfg = recipe.model_copy(update={"lsa_rerank_codec": "exact", "lsa_rerank_on_device": False, "lsa_cache_pages": 0})
    flash = estimate("llama-3.1-8b", tokens=TOKENS, config=cfg).flashmem
    assert flash is not None and flash.tier_counts["working_set"] == 4096
    # without the head size and dtype, a re-ranking config's keys and FLOPs cannot be counted
    with pytest.raises(ConfigError, match="needs head_dim, dtype_bytes and group"):
        hwm.predicted_traffic(flash, cfg, TOKENS, hwm.Assumptions(dispatch="off"))
    # a working set in the model's dtype: the new pages cross as the cold tier holds them
    plain = cfg.model_copy(update={"working_set_codec": "model"})
    host = hwm.predicted_traffic(flash, plain, TOKENS, hwm.Assumptions(dispatch="off"), 128, 2, 4)
    assert host.parts["rerank_keys"] == 0 and host.host_read_bytes == 1024 * 16 * KV_TOKEN / 2
    assert host.link_bytes == pytest.approx(0.4 * 4096 * KV_TOKEN)
    # the host scores them: 16,384 keys x 4 query heads x 32 layers x 8 KV heads x (2 x 128 + 4)
    assert host.host_flops == 16384 * 4 * 32 * 8 * (2 * 128 + 4)
    # given the head size and dtype, the int8 working set's new pages cross as codes: (1 + 4/128) / 2 of bf16
    coded = hwm.predicted_traffic(
        flash, cfg, TOKENS, hwm.Assumptions(dispatch="off"), head_dim=128, dtype_bytes=2, group=4
    )
    assert coded.link_bytes == pytest.approx(0.4 * 4096 * KV_TOKEN * (1 + 4 / 128) / 2)
    assert coded.host_read_bytes == host.host_read_bytes
    # over the link (the old path) the pages cross as the cold tier holds them
    linked = hwm.predicted_traffic(flash, cfg, TOKENS, hwm.Assumptions(dispatch="off", rerank_keys="link"), 128, 2)
    assert linked.parts["new_pages"] == pytest.approx(0.4 * 4096 * KV_TOKEN)
    a = hwm.Assumptions(dispatch="off", rerank_keys="link")
    tr = hwm.predicted_traffic(flash, cfg, TOKENS, a, 128, 2, 4)
    assert tr.parts["rerank_keys"] == 1024 * 16 * KV_TOKEN / 2 == 2**30
    assert tr.host_flops == 0 and tr.rerank_device_flops == 16384 * 4 * 32 * 8 * (2 * 128 + 4)  # on the device
    assert tr.parts["new_pages"] == pytest.approx(0.4 * 4096 * KV_TOKEN)
    assert tr.link_bytes == pytest.approx(2**30 + 0.4 * 4096 * KV_TOKEN)
    # a step that keeps the page count writes its new pages (0.4) into the slots of those that left
    # (a read and a write); one that changes it rebuilds the working set (two reads and two writes):
    # a block's seal, and each time the open block's filling takes back a page's room (63 tokens x
    # 512 B over int8 pages of 16 x 2 x (128 + 4) B: 7.6 times a 64-token block)
    rebuilds = (1 + 63 * 512 / 4224) / 64
    merge = (rebuilds * 4 + (1 - rebuilds) * 2 * 0.4) * flash.tiers["working_set"]
    assert tr.working_set_merge_bytes == pytest.approx(merge) and merge > 0
    # attention's buffer: every attended token's K and V (512 B in bf16) written and read back; the
    # int8 working set decoded into it in one pass; the int8 index converted to bf16 for its scores
    # (written, read back); 32 layers x 8 KV heads
    c = flash.tier_counts
    assert cfg.lsa_index_dtype == "int8" and not cfg.use_summaries
    attended = c["sinks"] + c["window"] + c["open_block"] + 4096
    assembly = 32 * 8 * (2 * attended * 512 + 2 * c["index_key_vectors"] * 128 * 2)
    assert tr.assembly_bytes == pytest.approx(assembly) and assembly > flash.device_resident_bytes
    assert tr.device_read_bytes == pytest.approx(flash.device_resident_bytes + tr.link_bytes + merge + assembly)
    row = hwm.flashmem_row(hw, cost, TOKENS, 1, a, tr, flash.cold_bytes, None)
    assert row.step_s == pytest.approx(tr.link_bytes / LINK) and row.bound == "link"  # ~23 ms
    fixed = WEIGHTS + ALLOW + flash.prompt_kv_bytes  # one sequence's exact prompt at a time
    assert row.largest_batch == math.floor((HBM - fixed) / flash.device_resident_bytes)
    # ranked on the device: only new pages cross, and batch 1 is then faster than the full cache
    dev = hwm.predicted_traffic(flash, cfg, TOKENS, hwm.Assumptions(dispatch="off", rerank_keys="device"))
    assert dev.parts["rerank_keys"] == 0 and dev.link_bytes == pytest.approx(0.4 * 4096 * KV_TOKEN)
    # the streamed prompt: chunk j of 512 reads every earlier token past the sinks and window
    resident_tok = flash.tier_counts["sinks"] + flash.tier_counts["window"]
    behind = sum(max(0, j * 512 - resident_tok) for j in range(TOKENS // 512))
    assert tr.prefill_link_bytes == pytest.approx(behind * KV_TOKEN)


def test_overrides_and_mistakes():
    hw = hwm.get_hardware("H200", hbm_gbps=1000, link_gbps=64, hbm_gib=100, tflops=500)
    assert hw.hbm_bytes_per_s == 1e12 and hw.link_bytes_per_s == 64e9
    assert hw.hbm_bytes == 100 * 2**30 and hw.peak_flops == 500e12
    assert "overridden" in hw.source
    with pytest.raises(ConfigError, match="allowed: h100, h200, a100, l4"):
        hwm.get_hardware("h300")
    for bad in (-1, 0, float("nan")):
        with pytest.raises(ConfigError, match="--link-gbps"):
            hwm.get_hardware("h100", link_gbps=bad)
    with pytest.raises(ConfigError, match="--new-page-fraction"):
        hwm.Assumptions(dispatch="off", new_page_fraction=1.5).check()
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="--new-candidate-fraction"):
            hwm.Assumptions(dispatch="off", new_candidate_fraction=bad).check()
    assert hwm.Assumptions(dispatch="off", new_page_fraction=0.2).candidate_fraction == 0.2
    assert (
        hwm.Assumptions(dispatch="off", new_page_fraction=0.2, new_candidate_fraction=0.05).candidate_fraction == 0.05
    )
    with pytest.raises(ConfigError, match="--params"):
        hwm.model_cost("mystery", layers=2, kv_bytes_per_token=1, dtype_bytes=2, q_width=1)
    with pytest.raises(ConfigError, match="missing the object 'per_decode_step_median'"):
        hwm.check_traffic({"steps": {}, "totals": {}})
    report = synthetic_report(1, 2, 3, 4)
    report["per_decode_step_median"]["h2d_bytes"] = -5
    with pytest.raises(ConfigError, match="per_decode_step_median.h2d_bytes"):
        hwm.check_traffic(report)


def test_arch_from_an_hf_config_matches_the_built_in():
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "tie_word_embeddings": False,
    }
    assert hwm.arch_from_config(cfg) == hwm.ARCHS["llama-3.1-8b"]
    assert hwm.arch_from_config(json.loads(json.dumps({**cfg, "num_local_experts": 8}))) is None
    assert hwm.arch_from_config({"hidden_size": 8}) is None


def test_arch_params_equal_the_real_models_parameter_count():
    """Arch.params against transformers' own models (tiny random ones)."""
    from tiny_models import MODELS

    for build in MODELS.values():
        model = build()
        arch = hwm.arch_from_config(model.config.to_dict())
        assert arch is not None
        assert arch.params == sum(p.numel() for p in model.parameters()), type(model).__name__


def test_the_caches_own_traffic_names_are_accepted(h200):
    """cache.traffic_report() names a prompt's forwards `prefill_forwards` /
    `per_prefill_forward_median` and adds keys of its own: both schemas read the same."""
    report = synthetic_report(10**9, 50 * 10**6, 10**8, 256)
    report["steps"] = {"prefill_forwards": 256, "decode_steps": 16}
    report["per_prefill_forward_median"] = dict(report.pop("per_prefill_chunk_median"), full_cache_bytes=1)
    report["per_decode_step_median"]["full_cache_bytes"] = KV_SEQ
    hwm.check_traffic(report)
    tr = hwm.counted_traffic(report, 2**30, 0, "cache names")
    assert tr.prefill_link_bytes == 256 * 10**8 and tr.link_bytes == 50 * 10**6


def test_counted_redos_join_a_step_as_their_share_of_the_decode_steps(h200):
    """A run with exact_on_doubt counts its redo forwards apart (`steps.redo_forwards`,
    `per_redo_forward_median`): 4 of 16 steps redone, each copying 2 GB and feeding 6 tokens
    again, add a quarter of 2 GB to a step's link bytes and a second forward of 6 tokens at that
    share, as a predicted redo does."""
    hw, cost, a = h200
    plain = synthetic_report(10**9, 50 * 10**6, 10**8, 256)
    report = json.loads(json.dumps(plain))
    report["steps"].update(redo_forwards=4, redo_tokens=24)
    report["per_redo_forward_median"] = dict(plain["per_prefill_chunk_median"], h2d_bytes=2 * 10**9)
    hwm.check_traffic(report)
    tr = hwm.counted_traffic(report, 2**30, 0, "redone")
    assert (tr.redo_fraction, tr.redo_tokens) == (0.25, 6)
    assert tr.link_bytes == pytest.approx(50 * 10**6 + 0.25 * 2 * 10**9)
    assert "4 of its 16 decode steps redone" in tr.source
    base = hwm.counted_traffic(plain, 2**30, 0, "plain")
    assert base.redo_fraction == 0 and base.link_bytes == 50 * 10**6
    row, row0 = (hwm.flashmem_row(hw, cost, TOKENS, 1, a, t, KV_SEQ, None) for t in (tr, base))
    assert row.step_s > row0.step_s and row.prefill_link_bytes == row0.prefill_link_bytes
    del report["per_redo_forward_median"]
    with pytest.raises(ConfigError, match="'per_redo_forward_median' is missing") as err:
        hwm.check_traffic(report)
    assert "\n" not in str(err.value)


def test_a_cache_that_does_not_fit_has_no_ratio():
    """At 1M tokens Llama-3.1-8B's cache (128 GiB) does not fit an H100 next to its weights:
    the full row has no batch, and the targets say so instead of printing a ratio."""
    hw, a = hwm.get_hardware("h100"), hwm.Assumptions(dispatch="off")
    cost = hwm.model_cost("llama-3.1-8b", layers=32, kv_bytes_per_token=KV_TOKEN, dtype_bytes=2, q_width=0)
    full = hwm.full_row(hw, cost, 2**20, 1, a)
    assert full.largest_batch == 0 and not full.fits
    tr = hwm.counted_traffic(synthetic_report(10**9, 10**7, 0, 0), 2**30, 0, "x")
    flash = hwm.flashmem_row(hw, cost, 2**20, 1, a, tr, KV_TOKEN * 2**20, None)
    assert flash.fits and flash.largest_batch == (81559 * 2**20 - WEIGHTS - ALLOW) // 2**30
    tg = hwm.targets(hw, cost, a, full, flash, tr)
    assert tg["throughput_ratio_at_largest_batch"] is None and "the full cache does not fit" in tg["note"]


# ----------------------------------------------------------------------------- the re-rank on the host
# By hand: 2 layers x 2 KV heads x 16 dims, bf16: a sealed token is 2 x 2 x 16 x (K + V) x 2 B =
# 256 B in the cold tier, 64 key elements. Blocks of 64 tokens in pages of 16 (4 a block).
SMALL = dict(layers=2, kv_heads=2, head_dim=16, dtype="bfloat16")


def small_config(**kw) -> FlashMemoryConfig:
    base = dict(sink_tokens=4, gpu_cache_limit=124, hca_chunk_size=64, lsa_page_tokens=16, lsa_top_k=8,
                lsa_rerank=4, lsa_rerank_min_pages=16, csa_band_tokens=0, working_set_codec="model")  # fmt: skip
    return FlashMemoryConfig(**{**base, **kw})


def small_traffic(cfg: FlashMemoryConfig, a: hwm.Assumptions | None = None) -> hwm.FlashTraffic:
    flash = estimate(None, tokens=8192, config=cfg, **SMALL).flashmem
    assert flash is not None and flash.cold_bytes_per_token == 256
    # 8,192 tokens: 126 sealed blocks (504 pages); 8 pages of 16 tokens selected per layer
    assert flash.tier_counts["sealed_blocks"] == 126 and flash.tier_counts["working_set"] == 128
    return hwm.predicted_traffic(
        flash, cfg, 8192, a or hwm.Assumptions(dispatch="off"), head_dim=16, dtype_bytes=2, group=3
    )


# bytes one key element costs each codec: bf16; bits/8 + an fp16 scale and zero per channel over 64 tokens
@pytest.mark.parametrize(
    "codec,key_bytes", [("exact", 2.0), ("int4", 0.5 + 4 / 64), ("int2", 0.25 + 4 / 64), ("sign", 0.125 + 4 / 64)]
)
def test_rerank_host_bytes_and_flops_by_codec(codec, key_bytes):
    """max(4 x 8, 16) = 32 candidate pages (512 tokens) per KV head and layer, 64 key elements a
    token over the layers: 32,768 key elements read on the host; 3 query heads score each key."""
    tr = small_traffic(small_config(lsa_rerank_codec=codec))
    assert tr.host_read_bytes == {"exact": 65536, "int4": 18432, "int2": 10240, "sign": 6144}[codec]
    assert tr.host_read_bytes == 512 * 64 * key_bytes
    # 512 keys x 3 queries x (2 x 64 elements + 4 softmax FLOPs x 4 scores: 2 layers x 2 KV heads)
    assert tr.host_flops == 512 * 3 * (2 * 64 + 4 * 4) == 221184
    assert tr.link_bytes == pytest.approx(0.4 * 128 * 256)  # only new pages cross
    assert f"re-rank {codec} " in tr.source and "on the host" in tr.source
    # over the link (--rerank-keys link) the same bytes cross and the device scores them
    linked = small_traffic(small_config(lsa_rerank_codec=codec), hwm.Assumptions(dispatch="off", rerank_keys="link"))
    assert linked.parts["rerank_keys"] == tr.host_read_bytes and linked.host_read_bytes == 0
    assert linked.rerank_device_flops == 221184 and linked.host_flops == 0
    # a disk cold tier reads exact candidates' blocks whole (K and V); codes sit in host memory
    # (coded at seal), so a disk tier reads none of them
    disk = small_traffic(small_config(lsa_rerank_codec=codec, cold_store="disk", cold_dir="/tmp/unused"))
    new = 0.4 * 128 * 256
    assert disk.disk_bytes == pytest.approx(new + (2 * 65536 if codec == "exact" else 0))


def test_rerank_in_place_scores_every_sealed_page():
    """Candidates a third of the pages or more (3 x 200 >= 504) are scored in place over every
    sealed block of a memory tier (cache/ranking.py): 504 pages x 16 = 8,064 tokens per head."""
    from flashmem.cache.ranking import IN_PLACE_CANDIDATES

    assert hwm.IN_PLACE_CANDIDATES == IN_PLACE_CANDIDATES
    tr = small_traffic(small_config(lsa_rerank_min_pages=200))
    assert tr.host_read_bytes == 8064 * 64 * 2 and tr.host_flops == 8064 * 3 * (2 * 64 + 16)
    assert "in place over every sealed page" in tr.source
    # 167 candidates: 3 x 167 = 501 < 504, the candidates only
    assert small_traffic(small_config(lsa_rerank_min_pages=167)).host_read_bytes == 167 * 16 * 64 * 2


def test_the_bound_is_host_compute_when_the_host_is_slow(h200):
    hw, cost, a = h200
    tr = small_traffic(small_config(lsa_rerank_codec="sign"))
    assert hwm.HOST_FLOPS == 2 * 56 * 2 * 16 * 2 * 2.0e9 * 0.1 and hw.host_flops == hwm.HOST_FLOPS
    slow = hwm.get_hardware("h200", host_tflops=1e-6)  # 1 MFLOP/s: 221,184 FLOPs take 0.22 s
    assert slow.host_flops == 1e6 and "host_flops" in slow.source
    row = hwm.flashmem_row(slow, cost, 8192, 1, a, tr, 8064 * 256, None)
    assert row.bound == "host compute" and row.step_s == pytest.approx(221184 / 1e6)
    assert row.bound_at_largest == "host compute"
    assert row.step_s_at_largest == pytest.approx(row.largest_batch * 221184 / 1e6)
    # at the default rate the same step is bound elsewhere
    assert hwm.flashmem_row(hw, cost, 8192, 1, a, tr, 8064 * 256, None).bound != "host compute"
    t, bound = hwm.step_time(hw, hwm.Assumptions(dispatch="off", overlap=False), hbm=0, host_flops=hw.host_flops)
    assert t == pytest.approx(1.0) and bound == "host compute (serial sum)"
    # a host that misses the target alone leaves no link budget for it
    full1 = hwm.full_row(slow, cost, 8192, 1, a)
    assert hwm.targets(slow, cost, a, full1, row, tr)["link_bytes_per_seq_step_for_target"] is None
    with pytest.raises(ConfigError, match="--host-tflops"):
        hwm.get_hardware("h200", host_tflops=0)


def test_measured_new_page_fractions_are_the_runs():
    """The fractions beside the default are 1 - the lower page hit rate of each results file."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for m in hwm.MEASURED_NEW_PAGE_FRACTIONS:
        path = root / m.source.split(":")[0]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rates = [r["page_hit_rate"] for r in rows]
        assert rates and m.new_page_fraction == pytest.approx(1 - min(rates), abs=5e-4), m
        if m.new_candidate_fraction is not None:
            cand = min(r["candidate_hit_rate"] for r in rows)
            assert m.new_candidate_fraction == pytest.approx(1 - cand, abs=5e-4), m


# ----------------------------------------------------------------------------- codes held on the device
# By hand, SMALL at 8,192 tokens: 32 candidate pages per KV head and layer (as above); a page's codes are
# 16 tokens x 16 dims x bits/8 plus an fp16 zero and scale per channel (4 x 16 = 64 B); 2 layers x 2 KV heads
HELD = {"int4": 4 * 32 * (128 + 64), "int2": 4 * 32 * (64 + 64), "sign": 4 * 32 * (32 + 64)}


@pytest.mark.parametrize("codec", ["int4", "int2", "sign"])
def test_rerank_codes_held_on_the_device(codec):
    """lsa_rerank_on_device: the codes sit in the resident bytes (the calculator's index tier), a
    step copies only the new candidates' codes and scores them on the device; the host reads and
    computes nothing, so a slow host no longer bounds the step."""
    assert HELD == {"int4": 24576, "int2": 16384, "sign": 12288}
    on_host = small_config(lsa_rerank_codec=codec)
    held_cfg = small_config(lsa_rerank_codec=codec, lsa_rerank_on_device=True)
    tr = small_traffic(held_cfg)
    assert tr.held_code_bytes == HELD[codec]
    # resident bytes: the host-scored config's plus exactly the held codes
    base = estimate(None, tokens=8192, config=on_host, **SMALL).flashmem
    flash = estimate(None, tokens=8192, config=held_cfg, **SMALL).flashmem
    assert base is not None and flash is not None
    assert flash.device_resident_bytes == base.device_resident_bytes + HELD[codec] == tr.resident_bytes
    # link: the new pages (0.4 x 128 tokens x 256 B) and 0.4 of the held codes; no host, no disk for codes
    new_pages = 0.4 * 128 * 256
    assert tr.parts["new_pages"] == pytest.approx(new_pages)
    assert tr.parts["rerank_keys"] == pytest.approx(0.4 * HELD[codec])
    assert tr.link_bytes == pytest.approx(new_pages + 0.4 * HELD[codec])
    assert tr.host_read_bytes == 0 and tr.host_flops == 0 and tr.parts["rerank_keys_on_host"] == 0
    assert tr.rerank_device_flops == 512 * 3 * (2 * 64 + 4 * 4) == 221184  # as on the host, now the device's
    # the device reads its resident bytes (codes included) and what arrived, and writes and reads back
    # the candidates' keys decoded in the model's dtype: 2 x 512 tokens x 64 key elements x 2 B
    assert tr.parts["rerank_decoded_keys"] == 2 * 512 * 64 * 2
    assert small_traffic(on_host).parts["rerank_decoded_keys"] == 0  # decoded on the host: no HBM
    # no open room here: rebuilt at a block's seal (1 step in 64, two reads and two writes), else
    # the new pages written in place (a read and a write of 0.4 of it)
    merge = (4 / 64 + 63 / 64 * 2 * 0.4) * flash.tiers["working_set"]
    # attention's buffer: 4 sinks + 124 window + 126 HCA entries + 128 selected tokens' K and V (64 B
    # in bf16; the open block is empty at 8,192), written and read back, per layer and KV head (a
    # model-dtype index: nothing converted)
    assert flash.tier_counts["open_block"] == 0 and held_cfg.use_summaries
    assert tr.assembly_bytes == 2 * 2 * 2 * (4 + 124 + 126 + 128) * 64
    assert tr.device_read_bytes == pytest.approx(
        flash.device_resident_bytes + tr.link_bytes + 131072 + merge + tr.assembly_bytes
    )
    assert "held on the device" in tr.source and "on the host" not in tr.source
    # the new-candidate fraction, given, replaces the new-page fraction for the codes only
    own = small_traffic(held_cfg, hwm.Assumptions(dispatch="off", new_candidate_fraction=0.1))
    assert own.link_bytes == pytest.approx(new_pages + 0.1 * HELD[codec])
    # a disk cold tier: the codes come from the host's arena, only new pages from disk
    disk = small_traffic(small_config(lsa_rerank_codec=codec, lsa_rerank_on_device=True, cold_store="disk",
                                      cold_dir="/tmp/unused"))  # fmt: skip
    assert disk.disk_bytes == pytest.approx(new_pages) and disk.held_code_bytes == HELD[codec]
    # past lsa_rerank_max_tokens nothing is re-ranked: no codes held, none copied
    capped = small_config(lsa_rerank_codec=codec, lsa_rerank_on_device=True, lsa_rerank_max_tokens=4096)
    off = small_traffic(capped)
    assert off.held_code_bytes == 0 and off.link_bytes == pytest.approx(new_pages) and off.rerank_device_flops == 0


def test_codes_on_the_device_set_the_batch_and_the_bound():
    """A host of 1 MFLOP/s bounds the host-scored step (221,184 FLOPs: 0.22 s); held on the device the
    same scores are the device's, and the step is bound by HBM or the link. The largest batch is the
    HBM left after the weights over the resident bytes with the codes: by hand."""
    slow = hwm.get_hardware("h200", host_tflops=1e-6, hbm_gib=1)
    a = hwm.Assumptions(dispatch="off", activation_bytes=0)
    cost = hwm.model_cost("small", layers=2, kv_bytes_per_token=256, dtype_bytes=2, q_width=6 * 16, params=10**6)
    host_tr = small_traffic(small_config(lsa_rerank_codec="int4"), a)
    dev_tr = small_traffic(small_config(lsa_rerank_codec="int4", lsa_rerank_on_device=True), a)
    host_row = hwm.flashmem_row(slow, cost, 8192, 1, a, host_tr, 8064 * 256, None)
    dev_row = hwm.flashmem_row(slow, cost, 8192, 1, a, dev_tr, 8064 * 256, None)
    assert host_row.bound == "host compute" and host_row.bound_at_largest == "host compute"
    assert not dev_row.bound.startswith("host") and not dev_row.bound_at_largest.startswith("host")
    assert dev_row.device_bytes_per_seq == host_row.device_bytes_per_seq + 24576
    assert dev_row.largest_batch == (2**30 - 2 * 10**6) // (host_tr.resident_bytes + 24576)
    assert dev_row.largest_batch < host_row.largest_batch
    # at the largest batch: the link carries (new pages + 0.4 x codes) per sequence, HBM the weights and
    # (resident + arrived) per sequence; the step is the slower of them (device FLOPs are far below)
    big = dev_row.largest_batch
    link_s = big * (0.4 * 128 * 256 + 0.4 * 24576) / 55e9
    hbm_s = (2 * 10**6 + big * (dev_tr.resident_bytes + dev_tr.link_bytes)) / 4.8e12
    assert dev_row.step_s_at_largest == pytest.approx(max(link_s, hbm_s))
    assert dev_row.bound_at_largest == ("link" if link_s > hbm_s else "HBM")


def test_page_cache_is_held_but_not_read_by_a_step():
    """The recipe at 1/8 and 128K fills the room the cap and the codes leave with pages past the
    selection (lsa_cache_pages): they count in the resident bytes (and so in the largest batch),
    but a step reads only those that pages leaving the selection replace (read and write, at
    most the selection's bytes), not the whole cache."""
    recipe = FlashMemoryConfig.for_budget(1 / 8, TOKENS, group=4, head_dim=128, dtype_bytes=2)
    assert recipe.lsa_cache_pages > 0
    bare = recipe.model_copy(update={"lsa_cache_pages": 0})
    f1 = estimate("llama-3.1-8b", tokens=TOKENS, config=recipe).flashmem
    f0 = estimate("llama-3.1-8b", tokens=TOKENS, config=bare).flashmem
    assert f1 is not None and f0 is not None
    a = hwm.Assumptions(dispatch="off")
    t1 = hwm.predicted_traffic(f1, recipe, TOKENS, a, 128, 2, 4)
    t0 = hwm.predicted_traffic(f0, bare, TOKENS, a, 128, 2, 4)
    cache = f1.device_resident_bytes - f0.device_resident_bytes
    assert cache > 0 and t1.page_cache_bytes == pytest.approx(cache)
    assert t1.resident_bytes == f1.device_resident_bytes  # the budget holds it
    selection = f0.tiers["working_set"]
    assert t1.device_read_bytes == pytest.approx(t0.device_read_bytes + 2 * min(cache, selection))
    # the cache is not rebuilt: the merge's bytes are the selection's
    assert t1.working_set_merge_bytes == pytest.approx(t0.working_set_merge_bytes)
    assert t0.working_set_merge_bytes == pytest.approx(((1 + 63 * 512 / 4224) / 64 * 3.2 + 0.8) * selection)
    assert t1.link_bytes == t0.link_bytes  # the new-page fraction is an assumption: measured with the cache


def test_assembly_bytes_charge_the_buffer_and_the_index_conversion():
    """What a step writes and reads back besides its tiers: attention's buffer (every attended
    token's K and V in the model's dtype), the same for an int8 working set (decoded into it in
    one pass on an accelerator), plus an int8 or float16 index converted to the (bf16) model's dtype;
    0 where the geometry is unknown."""
    base = small_traffic(small_config())
    assert base.assembly_bytes == 2 * 2 * 2 * (4 + 124 + 126 + 128) * 64  # 2 layers x 2 KV heads
    assert small_traffic(small_config(working_set_codec="int8")).assembly_bytes == base.assembly_bytes
    index = 2 * 2 * 2 * 1008 * 16 * 2  # 1,008 pages' mean keys of 16 elements, written and read in bf16
    assert small_traffic(small_config(lsa_index_dtype="int8")).assembly_bytes == base.assembly_bytes + index
    # float16 vectors under a bf16 model are converted too
    assert small_traffic(small_config(lsa_index_dtype="float16")).assembly_bytes == base.assembly_bytes + index
    flash = estimate(None, tokens=8192, config=small_config(), **SMALL).flashmem
    assert flash is not None
    assert hwm.assembly_bytes(small_config(), flash.tier_counts, 256, None, None) == 0


def test_the_hosts_operator_launches_bound_a_small_step(h200):
    """`dispatch`: each step's operators cost the host `op_launch_s` (kernels) and `view_op_s`
    (views) per layer, whatever the batch. Overlapped, a step takes the longer of the host and
    the device; serial (flashmem waits on the device within each layer), their sum; off, the
    roofline alone. By hand, from the counted operators per layer."""
    hw, cost, _ = h200
    host_full = 32 * (hwm.FULL_LAYER_OPS.kernels * 5e-6 + hwm.FULL_LAYER_OPS.views * 1e-6)
    host_flash = 32 * (hwm.FLASH_LAYER_OPS.kernels * 5e-6 + hwm.FLASH_LAYER_OPS.views * 1e-6)
    assert hwm.FLASH_LAYER_OPS.waits > 0 and hwm.FULL_LAYER_OPS.waits == 0
    over, serial, off = (hwm.Assumptions(dispatch=d) for d in ("overlap", "serial", "off"))
    assert hwm.FULL_LAYER_OPS.seconds(over, 32) == pytest.approx(host_full)
    assert hwm.FULL_LAYER_OPS.seconds(off, 32) == 0
    roofline = (WEIGHTS + KV_SEQ) / BW
    assert hwm.full_row(hw, cost, TOKENS, 1, over).step_s == pytest.approx(max(roofline, host_full))
    # at the largest batch the device's time is the longer: the host's launches do not show
    assert hwm.full_row(hw, cost, TOKENS, 1, over).step_s_at_largest == pytest.approx((WEIGHTS + 7 * KV_SEQ) / BW)
    step_read = 10**9
    tr = hwm.counted_traffic(synthetic_report(step_read, 50 * 10**6, 10**8, 256), 2**30, 0, "synthetic")
    flash_roof = (WEIGHTS + step_read) / BW
    rows = {a.dispatch: hwm.flashmem_row(hw, cost, TOKENS, 1, a, tr, KV_SEQ, None) for a in (over, serial, off)}
    assert rows["off"].step_s == pytest.approx(flash_roof)
    assert rows["overlap"].step_s == pytest.approx(max(flash_roof, host_flash))
    assert rows["overlap"].bound == "host dispatch"
    assert rows["serial"].step_s == pytest.approx(flash_roof + host_flash)
    assert rows["serial"].bound == "HBM + host dispatch (serial)"
    with pytest.raises(ConfigError, match="--dispatch: 'sometimes' is not allowed; allowed: overlap, serial, off"):
        hwm.Assumptions(dispatch="sometimes").check()


@pytest.mark.parametrize("held", [False, True])
def test_a_selection_that_serves_several_steps(held, h200):
    """lsa_select_every r: the ranking's bytes and FLOPs, the working set's writes and the index's
    read come once in r steps; the new pages per step are kept (an upper bound); the operators are
    one selecting step's and r - 1 reusing ones' mean, waits kept (serial stays an upper bound)."""
    extra = dict(lsa_rerank_codec="int4", lsa_rerank_on_device=True) if held else dict(lsa_rerank_codec="int4")
    one = small_traffic(small_config(**extra))
    four = small_traffic(small_config(**extra, lsa_select_every=4))
    assert one.select_every == 1 and four.select_every == 4
    assert four.parts["new_pages"] == pytest.approx(one.parts["new_pages"])
    for part in ("rerank_keys", "rerank_keys_on_host", "rerank_decoded_keys"):
        assert four.parts[part] == pytest.approx(one.parts[part] / 4)
    assert four.host_flops == pytest.approx(one.host_flops / 4)
    assert four.rerank_device_flops == pytest.approx(one.rerank_device_flops / 4)
    assert four.working_set_merge_bytes == pytest.approx(one.working_set_merge_bytes / 4)
    flash = estimate(None, tokens=8192, config=small_config(**extra), **SMALL).flashmem
    assert flash is not None and flash.tiers["index"] > 0
    skipped = 0.75 * flash.tiers["index"]
    assert four.device_read_bytes == pytest.approx(
        one.device_read_bytes - skipped - 0.75 * (one.working_set_merge_bytes + one.parts["rerank_keys"])
        - 0.75 * one.parts["rerank_decoded_keys"]
    )  # fmt: skip
    assert four.resident_bytes == one.resident_bytes  # what the device holds does not change
    select = hwm.FLASH_DEVICE_CODES_OPS if held else hwm.FLASH_LAYER_OPS
    ops = hwm.flash_layer_ops(four)
    assert ops.kernels == pytest.approx(select.kernels / 4 + hwm.FLASH_REUSE_LAYER_OPS.kernels * 3 / 4)
    assert ops.views == pytest.approx(select.views / 4 + hwm.FLASH_REUSE_LAYER_OPS.views * 3 / 4)
    assert ops.waits == select.waits and hwm.flash_layer_ops(one) == select
    # fewer operators: a faster step at batch 1 whenever the host's launches bound it
    hw, cost, _ = h200
    a = hwm.Assumptions(dispatch="serial")
    r1 = hwm.flashmem_row(hw, cost, TOKENS, 1, a, one, KV_SEQ, None)
    r4 = hwm.flashmem_row(hw, cost, TOKENS, 1, a, four, KV_SEQ, None)
    assert r4.step_s < r1.step_s


def test_the_operator_counts_are_the_committed_runs():
    """The model's operator counts are those results/ops_per_step.json holds (per layer)."""
    from pathlib import Path

    per = json.loads((Path(__file__).parents[1] / "results" / "ops_per_step.json").read_text())["per_layer"]
    for const, key in (
        (hwm.FULL_LAYER_OPS, "full_cache"),
        (hwm.FLASH_LAYER_OPS, "flashmem_1_16"),
        (hwm.FLASH_DEVICE_CODES_OPS, "flashmem_device_codes_1_4"),
        (hwm.FLASH_REUSE_LAYER_OPS, "flashmem_reusing_step_1_16"),
    ):
        assert (const.kernels, const.views, const.waits) == (per[key]["kernels"], per[key]["views"], per[key]["waits"])


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_near_ties_redone_read_the_whole_cold_tier(store, h200, tmp_path):
    """exact_on_doubt: a redone step reads every sealed token's K/V over the link (and off a
    disk tier), so a step carries the redo share of the whole cold tier on average; its second
    forward reads the weights again and runs 1 / share tokens attending every earlier one."""
    from flashmem.cache.doubt import REDO_MAX_TOKENS

    assert hwm.REDO_MAX_TOKENS == REDO_MAX_TOKENS
    tier = dict(cold_store=store, cold_dir=str(tmp_path)) if store == "disk" else {}
    plain = small_traffic(small_config(**tier))
    doubt = small_traffic(small_config(**tier, exact_on_doubt=0.5))
    # 126 sealed blocks x 64 tokens x 256 B (K+V, both layers), 0.12 of the steps (measured)
    cold = 126 * 64 * 256
    assert doubt.redo_fraction == hwm.DOUBT_REDO_FRACTION == 0.12 and doubt.redo_tokens == 8
    assert doubt.parts["doubt_redo"] == pytest.approx(0.12 * cold)
    assert doubt.link_bytes == pytest.approx(plain.link_bytes + 0.12 * cold)
    assert doubt.disk_bytes == pytest.approx(plain.disk_bytes + (0.12 * cold if store == "disk" else 0))
    assert plain.redo_fraction == 0 and plain.parts["doubt_redo"] == 0
    # the cap binds a lower share; an assumed share replaces the measured one; 1 / share tokens, at most 64
    capped = small_traffic(small_config(**tier, exact_on_doubt=0.5, exact_on_doubt_share=0.05))
    assert capped.redo_fraction == 0.05 and capped.redo_tokens == 20
    rare = small_traffic(small_config(exact_on_doubt=0.5), hwm.Assumptions(dispatch="off", doubt_redo_fraction=0.01))
    assert rare.redo_fraction == 0.01 and rare.redo_tokens == REDO_MAX_TOKENS
    with pytest.raises(ConfigError, match="--doubt-redo-fraction: 1.5 is not allowed; allowed: 0 to 1"):
        hwm.Assumptions(doubt_redo_fraction=1.5).check()
    # the row: the weights once more per redo and sequence, the redo's FLOPs (8 tokens over 8,192)
    hw, cost, a = h200
    zero = hwm.FlashTraffic(**{**vars(doubt), "link_bytes": 0.0, "disk_bytes": 0.0, "host_read_bytes": 0.0})
    row = hwm.flashmem_row(hw, cost, 8192, 3, a, zero, 0.0, None)
    assert row.hbm_bytes_per_step == pytest.approx(cost.weight_bytes * (1 + 3 * 0.12) + 3 * doubt.device_read_bytes)
    base = hwm.flashmem_row(hw, cost, 8192, 3, a, hwm.FlashTraffic(**{**vars(zero), "redo_fraction": 0.0}), 0.0, None)
    assert row.step_s > base.step_s
