import pytest
import torch

from flashmem.errors import FlashMemError
from flashmem.sizing.budget import budget_config, predicted_ratio
from flashmem_eval import harness as H
from flashmem_eval.baselines import parse_method
from flashmem_eval.baselines.evicting import EvictingLayer, kv_bytes, new_cache
from flashmem_eval.baselines.kvpress_env import RUNNER, create_commands, press_ratio, runner_command
from flashmem_eval.baselines.snapkv import snapkv_compress, snapkv_keep
from flashmem_eval.baselines.streaming import StreamingCache, streaming_compress, streaming_sizes
from flashmem_eval.tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (1, n), generator=g)


@torch.no_grad()
def _cont_logits(model, cache, cont):
    return model(input_ids=cont, cache=cache, use_cache=True).logits


@torch.no_grad()
def test_streaming_window_covering_prompt_equals_full(model):
    ids, cont = _ids(100), _ids(20, 1)
    pre = H.prefill_full(model, ids)
    full = _cont_logits(model, H.eviction_cache(parse_method("full"), pre, 1.0), cont)
    s = _cont_logits(model, streaming_compress(pre.cache, 4, 200), cont)
    torch.testing.assert_close(s, full)
    # and the rolling cache built from the start gives the same as DynamicCache
    c = StreamingCache(model, sinks=4, window=500)
    out = model(input_ids=torch.cat([ids, cont], 1), cache=c, use_cache=True).logits
    ref = model(input_ids=torch.cat([ids, cont], 1)).logits
    torch.testing.assert_close(out, ref)


@torch.no_grad()
def test_eviction_matches_masked_full_attention(model):
    """A streaming cache == full attention with the evicted positions masked out."""
    n, m, sinks, window = 64, 8, 4, 20
    ids, cont = _ids(n), _ids(m, 1)
    pre = H.prefill_full(model, ids)
    cache = streaming_compress(pre.cache, sinks, 10_000)  # keep all, then roll by hand
    for layer in cache.layers:
        layer.roll(sinks, window)
        layer.window = None  # no further rolling during the continuation
    got = _cont_logits(model, cache, cont)
    # reference: one forward over prompt+cont with a 4D mask hiding the evicted keys
    total = n + m
    allowed = torch.ones(total, total, dtype=torch.bool).tril()
    evicted = torch.zeros(total, dtype=torch.bool)
    evicted[sinks : n - window] = True
    allowed[n:, evicted] = False
    mask = torch.zeros(1, 1, total, total)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    ref = model(input_ids=torch.cat([ids, cont], 1), attention_mask=mask).logits[:, n:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_snapkv_keeps_exactly_budget(model):
    ids = _ids(256)
    pre = H.prefill_full(model, ids)
    for b in (1 / 4, 1 / 8, 1 / 16, 1 / 32):
        keep = snapkv_keep(b, 256)
        cache = snapkv_compress(pre.cache, pre.captured, keep)
        for layer in cache.layers:
            assert layer.keys.shape[-2] == keep == round(b * 256)
            assert layer.get_seq_length() == 256
        r = H.cache_ratios(model, cache, 256)
        assert r["ratio"] == pytest.approx(b)
        # the observation window (last 64 prompt tokens) is always kept
        torch.testing.assert_close(
            cache.layers[0].keys[..., -min(64, keep) :, :], pre.cache.layers[0].keys[..., -min(64, keep) :, :]
        )
    # the source cache is untouched and positions continue at 256
    assert pre.cache.layers[0].keys.shape[-2] == 256
    out = model(input_ids=_ids(3, 2), cache=cache, use_cache=True)
    assert out.logits.shape[1] == 3 and cache.get_seq_length() == 259


@torch.no_grad()
def test_snapkv_full_budget_equals_full(model):
    ids, cont = _ids(128), _ids(16, 1)
    pre = H.prefill_full(model, ids)
    full = _cont_logits(model, H.eviction_cache(parse_method("full"), pre, 1.0), cont)
    snap = _cont_logits(model, snapkv_compress(pre.cache, pre.captured, 128), cont)
    torch.testing.assert_close(snap, full)


@torch.no_grad()
def test_snapkv_prefers_attended_positions(model):
    # With queries equal to a key direction, the matching position must be kept.
    from flashmem_eval.baselines.snapkv import snapkv_scores

    keys = torch.randn(1, 1, 100, 8) * 0.01
    keys[0, 0, 10] = torch.ones(8) * 5
    q = torch.ones(1, 2, 4, 8)
    s = snapkv_scores(q, keys, 1.0, kernel=1)
    assert int(s.argmax()) == 10


def test_streaming_sizes_and_bytes(model):
    assert streaming_sizes(0.25, 1000) == (4, 246)
    cache = new_cache(model)
    assert kv_bytes(cache)["total_bytes"] == 0


def test_parse_method():
    assert parse_method("full").kind == "full"
    assert parse_method("kvpress:TOVAPress").variant == "TOVAPress"
    assert parse_method("flashmem").variant == "default"
    assert parse_method("flashmem:raw").kind == "flashmem"
    for bad in ("kvpress:Nope", "flashmem:nope", "h2o"):
        with pytest.raises(FlashMemError, match="allowed"):
            parse_method(bad)


def test_kvpress_command_and_ratio(tmp_path):
    assert press_ratio(0.25) == 0.75
    cmd = runner_command(tmp_path / "venv/bin/python", tmp_path / "jobs.json")
    assert cmd == [str(tmp_path / "venv/bin/python"), str(RUNNER), str(tmp_path / "jobs.json")]
    assert RUNNER.is_file()
    create = create_commands(tmp_path / "v")
    assert create[0][1:] == ["-m", "venv", str(tmp_path / "v")]
    assert create[1][-3:] == ["kvpress==0.5.5", "transformers<5.3", "torch==2.13.0"]
    # the runner must not import flashmem (it runs in another environment)
    assert "import flashmem" not in RUNNER.read_text() and "from flashmem" not in RUNNER.read_text()


@pytest.mark.parametrize("tokens", [8192, 16384])
@pytest.mark.parametrize("budget", [1 / 4, 1 / 8, 1 / 16, 1 / 32])
def test_flashmem_budget_config(tokens, budget):
    cfg = budget_config(budget, tokens, "nocap")  # the budget filled (the cap below leaves it unused)
    assert predicted_ratio(cfg, tokens, peak=True) == pytest.approx(budget, rel=0.05)
    assert cfg.gpu_cache_limit < tokens


@pytest.mark.parametrize("tokens, budget", [(16384, 1 / 8), (65536, 1 / 8), (131072, 1 / 16)])
def test_selected_pages_are_capped_at_long_prompts(tokens, budget):
    """Past SELECTED_TOKENS_CAP the budget is a ceiling: the pages stop at the cap, the
    window stays where the budget put it, and the rest is left unused (not moved into the
    window, which a step attends too)."""
    from flashmem.recipe import DEVICE_RERANK, SELECTED_TOKENS_CAP

    capped, full = budget_config(budget, tokens), budget_config(budget, tokens, "nocap")
    assert full.lsa_top_k * full.page_tokens > SELECTED_TOKENS_CAP
    assert capped.lsa_top_k * capped.page_tokens == SELECTED_TOKENS_CAP
    # where the cap frees room, the solver may hold int4 candidate codes on the device
    # (recipe.DEVICE_RERANK); nothing else differs
    rerank = {key: getattr(capped, key) for key in DEVICE_RERANK}
    assert rerank in (DEVICE_RERANK, {key: getattr(full, key) for key in DEVICE_RERANK})
    # ... and pages past the selection in what is left (lsa_cache_pages), within the budget
    assert predicted_ratio(capped, tokens, peak=True) <= budget
    same = {"lsa_top_k": full.lsa_top_k, "lsa_cache_pages": 0, **{k: getattr(full, k) for k in DEVICE_RERANK}}
    assert capped.model_copy(update=same) == full
    # a model on the CPU gets neither: the rest is left unused (its re-rank may score an int8 copy
    # of the keys in host memory, recipe.HOST_RERANK, and it decides near ties exactly,
    # recipe.HOST_DOUBT: tests/test_recipe.py)
    on_cpu = budget_config(budget, tokens, device_codes=False)
    back = {
        "lsa_top_k": full.lsa_top_k,
        "lsa_rerank_mirror": "none",
        "exact_on_doubt": 0.0,
        "exact_on_doubt_min_mass": 0.0,
    }
    assert on_cpu.lsa_cache_pages == 0 and on_cpu.model_copy(update=back) == full
    assert predicted_ratio(on_cpu, tokens, peak=True) < 0.9 * budget
    assert predicted_ratio(full, tokens, peak=True) == pytest.approx(budget, rel=0.05)
    assert budget_config(budget, tokens, "cap8k").lsa_top_k * capped.page_tokens == min(
        8192, full.lsa_top_k * full.page_tokens
    )


@pytest.mark.parametrize("tokens, budget", [(4096, 1 / 8), (8192, 1 / 8), (16384, 1 / 16)])
def test_the_cap_leaves_shorter_prompts_alone(tokens, budget):
    assert budget_config(budget, tokens) == budget_config(budget, tokens, "nocap")


@pytest.mark.parametrize("tokens", [2021, 4070, 8150, 65536])
@pytest.mark.parametrize("budget", [1 / 8, 1 / 16, 1 / 32])
def test_budget_config_never_overshoots_and_buys_pages(tokens, budget):
    """Gemma3-270m's geometry: a page is a coarse step at 2K, so the solver must not
    trade every selected page for an overshoot; long prompts select more than 64 pages."""
    geo = {"group": 4, "head_dim": 256, "dtype_bytes": 4}
    cfg = budget_config(budget, tokens, **geo)
    r = predicted_ratio(cfg, tokens, **geo, peak=True)
    least = cfg.model_copy(update={"lsa_top_k": 0, "lsa_min_blocks": 0, "gpu_cache_limit": 8})
    if predicted_ratio(least, tokens, **geo, peak=True) <= budget:
        assert r <= 1.03 * budget
    else:  # sinks, the open block at its fullest and the index alone exceed it: the closest config
        assert cfg.lsa_top_k == 0 and cfg.gpu_cache_limit == 8
    assert not cfg.use_summaries and cfg.page_tokens == 16
    assert cfg.lsa_follow_pages == (1 if budget >= 1 / 8 or budget <= 1 / 32 else 0)  # following: recipe.py
    if budget >= 1 / 16:  # a page fits beside sinks, window, open block and index
        assert cfg.lsa_top_k >= 1
    if tokens == 65536 and budget == 1 / 8:  # more than 64 pages; the budget filled without the cap
        full = budget_config(budget, tokens, "nocap", **geo)
        assert cfg.lsa_top_k > 64 and full.lsa_top_k > 64
        assert predicted_ratio(full, tokens, **geo, peak=True) > 0.9 * budget


def test_evicting_layer_mask_sizes():
    layer = EvictingLayer(sinks=2, window=3)
    k = torch.randn(1, 1, 10, 4)
    fk, _ = layer.update(k, k)
    assert fk.shape[-2] == 10 and layer.stored() == 5 and layer.get_seq_length() == 10
    assert layer.get_mask_sizes(1) == (6, 5)


def test_kvpress_runner_in_venv_when_present(tmp_path):
    """Runs only where the kvpress venv was already created (never created in CI)."""
    from flashmem_eval.baselines.kvpress_env import run_jobs, venv_python
    from flashmem_eval.tiny import tiny_tokenizer

    if not venv_python().is_file():
        pytest.skip("kvpress venv not created here")
    m = tiny_llama(layers=2)
    m.save_pretrained(tmp_path / "hf")
    tiny_tokenizer().save_pretrained(tmp_path / "hf")
    ids = _ids(300)[0].tolist()
    jobs = [
        {
            "cell": f"{r}",
            "kind": "fidelity",
            "press": "SnapKVPress",
            "compression_ratio": r,
            "context": ids[:256],
            "cont": ids[256:],
            "chunk": 16,
        }
        for r in (0.0, 0.75)
    ]
    rows = {r["cell"]: r for r in run_jobs(str(tmp_path / "hf"), jobs, tmp_path / "w", threads=1)}
    assert rows["0.0"]["kl_mean"] == pytest.approx(0, abs=1e-7) and rows["0.0"]["ratio"] == 1.0
    assert rows["0.75"]["ratio"] == 0.25 and rows["0.75"]["kl_mean"] > 0


def test_for_budget_is_budget_config():
    from flashmem import FlashMemoryConfig

    assert FlashMemoryConfig.for_budget(1 / 8, 4096, group=4) == budget_config(1 / 8, 4096, "default", group=4)
    assert FlashMemoryConfig.for_budget(1 / 4, 2048, variant="quest", prefill_chunk=64) == budget_config(
        1 / 4, 2048, "quest", prefill_chunk=64
    )
    assert predicted_ratio(FlashMemoryConfig.for_budget(1 / 8, 8192), 8192, peak=True) == pytest.approx(1 / 8, rel=0.03)
