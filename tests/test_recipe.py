"""The recipe is the default: `attach(model)` sizes it to a budget, `configs/cpu-small.yaml`
is it, and the experiment variants live in the evaluation package."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import flashmem
from flashmem.config import AUTO_PREFETCH_THREADS, FlashMemoryConfig
from flashmem.errors import FlashMemError
from flashmem.recipe import DEFAULT_BUDGET, DEFAULT_TOKENS, HOST_DISK, RECIPE, default_tokens, recipe_keys
from flashmem.sizing.budget import full_kv_bytes, model_geometry, predicted_ratio
from tiny_models import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def _smollm2_shaped_on_cpu() -> torch.nn.Module:
    """A random model with SmolLM2-135M's attention geometry (9 query heads, 3 KV heads x 64,
    fp32) whose weights sit on the CPU: what the solver sees of SmolLM2 loaded on a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_cpu_small_yaml_is_the_recipe_at_one_eighth_of_8k_on_smollm2():
    yaml_cfg = FlashMemoryConfig.from_yaml(ROOT / "configs" / "cpu-small.yaml")
    # for SmolLM2 on a CPU (fp32, as load_model loads it): the recipe with the CPU's key copy
    assert yaml_cfg == FlashMemoryConfig.for_budget(1 / 8, 8192, _smollm2_shaped_on_cpu(), prefetch_threads=0)
    # by name (the calculator's SmolLM2) and by its geometry, the device is not known: no copy
    on_cpu = {"lsa_rerank_mirror": "int8", "exact_on_doubt": 0.5, "exact_on_doubt_min_mass": 0.05}
    by_name = FlashMemoryConfig.for_budget(1 / 8, 8192, "smollm2", prefetch_threads=0)
    assert by_name.lsa_rerank_mirror == "none" and by_name.exact_on_doubt == 0
    assert yaml_cfg == by_name.model_copy(update=on_cpu)
    by_geometry = FlashMemoryConfig.for_budget(1 / 8, 8192, group=3, head_dim=64, dtype_bytes=4, prefetch_threads=0)
    assert yaml_cfg == by_geometry.model_copy(update=on_cpu)
    for key, value in recipe_keys(1 / 8).items():
        assert getattr(yaml_cfg, key) == value, key


def test_a_model_on_the_cpu_decides_near_ties_exactly_where_its_cold_tier_can_be_read_back():
    """HOST_DOUBT: a CPU model gets `exact_on_doubt` with a memory cold tier of exact codes at real
    positions, at every length; not a disk or lossy tier, not `position_mode: window`, not a model
    whose device is not known, and a value the caller names stands."""
    model = tiny_llama()
    for budget, tokens in [(1 / 8, 8192), (1 / 16, 32768), (1 / 8, 131072)]:
        cfg = FlashMemoryConfig.for_budget(budget, tokens, model)
        assert (cfg.exact_on_doubt, cfg.exact_on_doubt_min_mass) == (0.5, 0.05)  # flat ties left as selected
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model, exact_on_doubt_min_mass=0).exact_on_doubt_min_mass == 0
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, "smollm2").exact_on_doubt == 0  # device unknown
    disk = FlashMemoryConfig.for_budget(1 / 8, 8192, model, cold_store="disk", cold_dir=str(ROOT / "unused"))
    assert disk.exact_on_doubt == 0  # a redo would read the whole disk tier
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model, cold_codec="int8").exact_on_doubt == 0
    window = FlashMemoryConfig.for_budget(1 / 8, 8192, model, position_mode="window", prefill_exact_tokens=0)
    assert window.exact_on_doubt == 0
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model, exact_on_doubt=0.2).exact_on_doubt == 0.2
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model, exact_on_doubt=0).exact_on_doubt == 0


def test_a_model_on_the_cpu_reranks_an_int8_key_copy_where_it_reranks_in_place():
    """The solver gives a CPU model `lsa_rerank_mirror: int8` where the re-rank scores every
    sealed page in place at the sized length (a third of the pages or more are candidates),
    with a memory cold tier, unless the caller or the variant names the re-rank's keys."""
    model = tiny_llama()
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model).lsa_rerank_mirror == "int8"
    assert FlashMemoryConfig.for_budget(1 / 16, 32768, model).lsa_rerank_mirror == "int8"
    # at 128K the 1,024 candidates are an eighth of the pages: gathered, so no copy
    assert FlashMemoryConfig.for_budget(1 / 8, 131072, model).lsa_rerank_mirror == "none"
    disk = FlashMemoryConfig.for_budget(1 / 8, 8192, model, cold_store="disk", cold_dir=str(ROOT / "unused"))
    assert disk.lsa_rerank_mirror == "none"  # the RAM is what a disk tier saves
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model, lsa_rerank_mirror="bf16").lsa_rerank_mirror == "bf16"
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model, variant="rrexact").lsa_rerank_mirror == "none"
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, model, variant="norerank").lsa_rerank_mirror == "none"
    assert FlashMemoryConfig.for_budget(1 / 8, 8192, "smollm2").lsa_rerank_mirror == "none"  # device unknown


def test_a_model_on_the_cpu_reads_a_disk_tier_without_a_prefetcher():
    """HOST_DISK through `prefetch_threads: auto`: a cache made for a CPU model with a disk tier
    of exact blocks reads its pages from the files, no prefetcher (whose buffer holds whole blocks
    in the RAM the tier saves), whether the config is the recipe's or written by hand; a memory or
    coded tier, a model on an accelerator, and a number the caller names keep loaders."""
    where = dict(cold_store="disk", cold_dir=str(ROOT / "unused"))
    model = tiny_llama()
    recipe = FlashMemoryConfig.for_budget(1 / 8, 8192, model, **where)
    assert recipe.prefetch_threads == "auto" and recipe.prefetch_threads_on("cpu") == HOST_DISK["prefetch_threads"]
    assert recipe.prefetch_threads_on("cuda") == AUTO_PREFETCH_THREADS > 0
    by_hand = FlashMemoryConfig(**where)
    assert by_hand.prefetch_threads_on("cpu") == 0
    assert FlashMemoryConfig().prefetch_threads_on("cpu") == AUTO_PREFETCH_THREADS
    assert FlashMemoryConfig(cold_codec="int8", **where).prefetch_threads_on("cpu") == AUTO_PREFETCH_THREADS
    assert (
        FlashMemoryConfig(cold_low_rank="keys", low_rank_dim=8, **where).prefetch_threads_on("cpu")
        == AUTO_PREFETCH_THREADS
    )
    assert FlashMemoryConfig(cold_store="layered", cold_dir=where["cold_dir"]).prefetch_threads_on("cpu") > 0
    assert FlashMemoryConfig(prefetch_threads=3, **where).prefetch_threads_on("cpu") == 3
    assert FlashMemoryConfig(prefetch_threads=0).prefetch_threads_on("cuda") == 0


def test_a_cache_settles_auto_prefetch_threads_for_its_models_device(tmp_path):
    """attach passes the model's device: a CPU model's disk tier of exact blocks opens no
    prefetcher, a number set by hand opens that many loaders, and a cache made for an accelerator
    (the same config) opens AUTO_PREFETCH_THREADS."""
    from flashmem.cache.flash_cache import FlashMemoryCache

    model = tiny_llama()
    cfg = FlashMemoryConfig(cold_store="disk", cold_dir=str(tmp_path / "cold"))
    with flashmem.attach(model, cfg) as cache:
        assert cache.prefetch_threads == 0 and cache.prefetcher is None
    with flashmem.attach(model, cfg, prefetch_threads=1) as cache:
        assert cache.prefetch_threads == 1 and cache.prefetcher is not None
    gpu = FlashMemoryCache(model.config, cfg, device="cuda")
    try:
        assert gpu.prefetch_threads == AUTO_PREFETCH_THREADS and gpu.prefetcher is not None
    finally:
        gpu.close()


def test_follow_pages_from_one_eighth_up_and_from_one_thirty_second_down():
    follows = {b: recipe_keys(b)["lsa_follow_pages"] for b in (1 / 4, 1 / 8, 1 / 12, 1 / 16, 1 / 24, 1 / 32, 1 / 64)}
    assert follows == {1 / 4: 1, 1 / 8: 1, 1 / 12: 0, 1 / 16: 0, 1 / 24: 0, 1 / 32: 1, 1 / 64: 1}
    assert FlashMemoryConfig.for_budget(1 / 16, 8192).lsa_follow_pages == 0
    assert FlashMemoryConfig.for_budget(1 / 32, 8192).lsa_follow_pages == 1
    # a caller's choice stands
    assert FlashMemoryConfig.for_budget(1 / 32, 8192, lsa_follow_pages=0).lsa_follow_pages == 0


def test_rest_entry_from_one_sixteenth_up_and_not_with_a_static_step():
    rests = {b: recipe_keys(b)["rest_entry"] for b in (1 / 4, 1 / 8, 1 / 12, 1 / 16, 1 / 24, 1 / 32)}
    assert rests == {1 / 4: True, 1 / 8: True, 1 / 12: True, 1 / 16: True, 1 / 24: False, 1 / 32: False}
    assert FlashMemoryConfig.for_budget(1 / 16, 8192).keeps_rest_entry
    assert not FlashMemoryConfig.for_budget(1 / 32, 8192).rest_entry
    # a caller's choice stands, both ways
    assert not FlashMemoryConfig.for_budget(1 / 8, 8192, rest_entry=False).rest_entry
    assert FlashMemoryConfig.for_budget(1 / 32, 8192, rest_entry=True).rest_entry
    # the static and graph steps have none: asking for them gives the recipe without it, not an error
    for step in ("static", "graph"):
        cfg = FlashMemoryConfig.for_budget(1 / 8, 8192, decode_step=step, lsa_rerank=1, lsa_cache_pages=0)
        assert cfg.decode_step == step and not cfg.rest_entry
    assert not FlashMemoryConfig.for_budget(1 / 8, 8192, variant="static").rest_entry
    # ... unless asked for by name, which the config refuses in one line
    with pytest.raises(FlashMemError, match="does not support rest_entry"):
        FlashMemoryConfig.for_budget(
            1 / 8, 8192, decode_step="static", lsa_rerank=1, lsa_cache_pages=0, rest_entry=True
        )


def test_bare_config_is_the_seed_layout_not_the_recipe():
    """A bare config is the base YAML keys lay over (documented in flashmem.recipe): it
    differs from the recipe in the keys the recipe sets."""
    bare = FlashMemoryConfig()
    assert bare.use_summaries and bare.hca_chunk_size == 128 and bare.gpu_cache_limit == 32768
    assert {k for k, v in RECIPE.items() if getattr(bare, k) != v} >= {"use_summaries", "lsa_scorer", "sink_tokens"}


def _decode_ratio(model, cache, tokens: int, steps: int = 4) -> float:
    """Device-resident bytes / a DynamicCache's bytes after a prefill of `tokens` and `steps`
    greedy decode steps (the budget holds from the first generated token); checked equal to
    the solver's prediction of the peak at the tokens seen (the budget's arithmetic is what the
    cache holds: with `lsa_open_room` the open block's unused room holds pages, so every step
    holds about what the solver sized, and never more)."""
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tok = flashmem.prefill(model, cache, ids).argmax(-1)  # [1, 1]
        for _ in range(steps):
            tok = model(tok.view(1, 1), cache=cache, use_cache=True).logits[:, -1].argmax(-1)
    rep = cache.memory_report()
    ratio = rep["device_resident_bytes"] / full_kv_bytes(model, rep["tokens_seen"], 4)["total_bytes"]
    predicted = predicted_ratio(cache.cfg, rep["tokens_seen"], **model_geometry(model), peak=True)
    assert ratio == pytest.approx(predicted, rel=0.03) and ratio <= predicted * 1.001
    return ratio


def _attach(model, *args, **kw):
    with warnings.catch_warnings():  # no layer profile for a random tiny model: an even split
        warnings.filterwarnings("ignore", message="lsa_layer_shares: profile")
        return flashmem.attach(model, *args, **kw)


def test_a_new_users_attach_holds_about_the_default_budget_at_8k():
    model = tiny_llama()
    cache = _attach(model)
    try:
        expected = FlashMemoryConfig.for_budget(DEFAULT_BUDGET, DEFAULT_TOKENS, model)
        assert cache.cfg.model_copy(update={"lsa_layer_shares": "profile"}) == expected
        ratio = _decode_ratio(model, cache, 8192)
    finally:
        cache.close()
        model.set_attn_implementation("sdpa")
    # measured from the tensors: 0.120 in the run that set this bound (sized for 8,192 tokens,
    # 8,196 seen: the window and pages as sized, the history a little longer)
    assert 0.85 * DEFAULT_BUDGET <= ratio <= 1.05 * DEFAULT_BUDGET, ratio


def test_attach_budget_and_tokens_keywords():
    model = tiny_llama()
    cache = _attach(model, budget=1 / 16, tokens=2048)
    try:
        assert cache.cfg.model_copy(update={"lsa_layer_shares": "profile"}) == FlashMemoryConfig.for_budget(
            1 / 16, 2048, model
        )
        ratio = _decode_ratio(model, cache, 2048)
        # a block's worth more steps: the open block fills once (63 tokens, a quarter of this
        # budget), the most the cache holds, which is what the solver sizes to the budget
        tok = torch.zeros(1, 1, dtype=torch.long)
        with torch.no_grad():
            for _ in range(cache.cfg.hca_chunk_size):
                cache_out = model(tok, cache=cache, use_cache=True)
                tok = cache_out.logits[:, -1:].argmax(-1)
        peak = cache.memory_report()["peak_managed_resident_bytes"] / full_kv_bytes(model, 2048, 4)["total_bytes"]
    finally:
        cache.close()
        model.set_attn_implementation("sdpa")
    # at 2K an 8-token window step and a 16-token page are coarse: between a seal and the next
    # the cache holds less than the budget (0.051 in the run that set this bound)
    assert 0.7 / 16 <= ratio <= peak, ratio
    # the peak over a whole block cycle, against the full cache at the length it was sized for
    assert 0.85 / 16 <= peak <= 1.05 / 16, peak


def test_default_tokens_is_capped_by_the_models_context():
    from flashmem_eval.tiny import build_llama

    short = build_llama(0, "sdpa", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                        max_position_embeddings=1024)  # fmt: skip
    assert default_tokens(short.config) == 1024
    assert default_tokens(tiny_llama().config) == DEFAULT_TOKENS
    cache = _attach(short)
    try:
        assert cache.cfg.gpu_cache_limit == FlashMemoryConfig.for_budget(1 / 8, 1024, short).gpu_cache_limit
    finally:
        cache.close()


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda m: flashmem.attach(m, FlashMemoryConfig(), budget=1 / 8), "not both"),
        (lambda m: flashmem.attach(m, FlashMemoryConfig(), tokens=4096), "not both"),
        (lambda m: flashmem.attach(m, "configs/cpu-small.yaml"), "allowed: a FlashMemoryConfig"),
        (lambda m: flashmem.attach(m, budget=2.0), "budget: 2.0"),
        (lambda m: flashmem.attach(m, tokens="8K"), "tokens: '8K'"),
    ],
)
def test_attach_arguments_are_one_line_errors(call, needle):
    model = tiny_llama()
    with pytest.raises(FlashMemError) as exc:
        call(model)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_experiment_variants_live_in_the_evaluation_package():
    import flashmem.sizing.budget as budget
    from flashmem_eval.variants import VARIANTS, variant

    assert not hasattr(budget, "VARIANTS")
    assert variant("default").keys == RECIPE
    nocap = FlashMemoryConfig.for_budget(1 / 8, 65536, variant="nocap")
    assert nocap.lsa_top_k * nocap.page_tokens > 4096  # the cap is the recipe's, not nocap's
    assert FlashMemoryConfig.for_budget(1 / 8, 4096, variant="norerank").lsa_rerank == 1
    with pytest.raises(FlashMemError, match="variant: 'nosuch' is not known; allowed: default"):
        FlashMemoryConfig.for_budget(1 / 8, 4096, variant="nosuch")
    assert len(VARIANTS) > 34


@pytest.mark.parametrize("name", ["quest", "summaries", "block", "balanced", "cap8k", "lrkv32-i8", "lrk32-pca"])
def test_each_kind_of_variant_builds_a_config(name):
    cfg = FlashMemoryConfig.for_budget(1 / 8, 2048, variant=name)
    assert isinstance(cfg, FlashMemoryConfig) and cfg.gpu_cache_limit >= 1


def test_the_open_blocks_room_buys_pages_and_no_step_passes_the_peak():
    """`lsa_open_room` (the recipe's): the working set grows by the bytes the open block does not
    use and shrinks as it fills, so over a block cycle the pages vary while no step holds more
    than the solver's peak; without it the pages stay as sized."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 2048), generator=torch.Generator().manual_seed(3))
    geo = model_geometry(model)
    for room in (True, False):
        # exact_on_doubt off: a redone step attends exactly and leaves no working set to count
        cache = _attach(model, budget=1 / 16, tokens=2048, lsa_open_room=room, exact_on_doubt=0)
        pages, over = [], []
        try:
            with torch.no_grad():
                tok = flashmem.prefill(model, cache, ids).argmax(-1)
                for _ in range(cache.cfg.hca_chunk_size + 2):
                    tok = model(tok.view(1, 1), cache=cache, use_cache=True).logits[:, -1].argmax(-1)
                    rep = cache.memory_report()
                    pages.append(cache.flash_layers[0].ws_idx.shape[-1])
                    peak = predicted_ratio(cache.cfg, rep["tokens_seen"], **geo, peak=True)
                    full = full_kv_bytes(model, rep["tokens_seen"], 4)["total_bytes"]
                    over.append(rep["device_resident_bytes"] / (peak * full))
        finally:
            cache.close()
            model.set_attn_implementation("sdpa")
        assert max(over) <= 1.001, max(over)
        if room:
            # about the peak on most steps (the step a block is sealed selects before the seal)
            assert max(pages) > min(pages) >= cache.cfg.lsa_top_k and sorted(over)[len(over) // 2] > 0.95
        else:
            assert max(pages) == min(pages) == cache.cfg.lsa_top_k


def test_the_recipe_on_an_accelerator_streams_the_prompt_in_4096_token_chunks(monkeypatch):
    """On a GPU the recipe's prompt chunk is 4,096 tokens (the streamed prompt is compute-bound,
    not link-bound); on a CPU 512; a caller's prefill_chunk wins; a given config is used as is."""
    from flashmem.cache import attach as attach_mod

    model = tiny_llama()
    try:
        assert _attach(model, budget=1 / 8, tokens=2048).cfg.prefill_chunk == 512
        monkeypatch.setattr(attach_mod, "_device_type", lambda m: "cuda")
        assert _attach(model, budget=1 / 8, tokens=2048).cfg.prefill_chunk == 4096
        assert _attach(model, budget=1 / 8, tokens=2048, prefill_chunk=1024).cfg.prefill_chunk == 1024
        given = FlashMemoryConfig.for_budget(1 / 8, 2048, model)
        assert _attach(model, given).cfg.prefill_chunk == given.prefill_chunk == 512
    finally:
        model.set_attn_implementation("sdpa")
