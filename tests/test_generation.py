"""generate() features through flashmem (cache/generation.py), each against DynamicCache.

With a config that keeps everything exact (every sealed page selected) flashmem
computes what DynamicCache does, so a crop that left a stale token, a row change
that read another beam's history from the cold tier, or a step on the wrong rows
shows up as different logits or different generated tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import flashmem
from flashmem.cache import generation
from flashmem.cache.flash_layer import FlashLayer
from flashmem.cache.generation import RowMappedPrefetcher, RowMappedStore
from flashmem.errors import FlashMemError
from test_cache import ALL_EXACT
from tiny_models import MODELS, tiny_llama

# Window 32, blocks of 16: a 100-token sequence has sealed blocks, an open block and a full window.
EXACT = dict(ALL_EXACT, gpu_cache_limit=32)
GEN = dict(do_sample=False, pad_token_id=0)


def exact_cfg(tmp_path=None, **extra) -> flashmem.FlashMemoryConfig:
    return flashmem.FlashMemoryConfig(**{**EXACT, **extra})


# The cold-tier read paths a row map must cover: a memory store read in place (its arena),
# and a disk store read through the prefetcher.
def cold_tiers(tmp_path) -> dict[str, dict]:
    return {
        "memory": {},
        "disk+prefetch": dict(cold_store="disk", cold_dir=str(tmp_path), prefetch_threads=2),
    }


class Pair:
    """A model run with flashmem and with DynamicCache side by side, forward by forward."""

    def __init__(self, model, cfg: flashmem.FlashMemoryConfig) -> None:
        self.model = model
        self.cache = flashmem.attach(model, cfg)
        self.ref = DynamicCache(config=model.config)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [b, q, vocab] of both caches for the next tokens ids [b, q]."""
        with torch.no_grad():
            out = self.model(ids, cache=self.cache, use_cache=True).logits
            self.model.set_attn_implementation("sdpa")
            try:
                ref = self.model(ids, cache=self.ref, use_cache=True).logits
            finally:
                self.model.set_attn_implementation("tiered_kv")
        return out, ref

    def check(self, ids: torch.Tensor) -> None:
        out, ref = self.forward(ids)
        assert out.shape == ref.shape
        assert (out - ref).abs().max() <= 1e-4

    def both(self, method: str, *args) -> None:
        getattr(self.cache, method)(*args)
        getattr(self.ref, method)(*args)
        assert self.cache.get_seq_length() == self.ref.get_seq_length()


def flash_layers(cache) -> list[FlashLayer]:
    return cache.flash_layers


# ---------------------------------------------------------------------------- crop
@pytest.mark.parametrize("tier", ["memory", "disk+prefetch"])
def test_crop_then_decode_equals_dynamic_cache(tier, tmp_path):
    """Draft-verify-crop cycles as assisted decoding makes them: a multi-token forward,
    then the rejected tail cropped (inside the window, and into the open block)."""
    torch.manual_seed(0)
    pair = Pair(tiny_llama(), exact_cfg(**cold_tiers(tmp_path)[tier]))
    pair.check(torch.randint(0, 128, (1, 100)))
    layer = flash_layers(pair.cache)[0]
    assert layer.sealed > 0 and layer.open_k.shape[-2] > 0
    for draft, reject in [(6, 5), (1, 0), (9, 9), (4, 1), (12, 3)]:
        pair.check(torch.randint(0, 128, (1, draft)))
        pair.both("crop", -reject)
        pair.check(torch.randint(0, 128, (1, 1)))
    # a crop of the whole window and part of the open block: the window refills from it
    open_before = layer.open_k.shape[-2]
    n = layer.win_k.shape[-2] + min(3, open_before)
    pair.both("crop", -n)
    assert layer.win_k.shape[-2] == min(32, layer.tokens_seen - layer.sink_k.shape[-2] - 16 * layer.sealed)
    for _ in range(3):
        pair.check(torch.randint(0, 128, (1, 2)))


@pytest.mark.parametrize("codec", ["exact", "int8"])
def test_a_crop_ends_the_exact_prompt(codec):
    """Verify forwards carry several tokens: the exact prompt (streamed for an exact cold
    tier, buffered on the device for a lossy one) ends at the first crop, as at a one-token
    forward, and its buffer is released; later forwards select (all pages here: exact)."""
    torch.manual_seed(1)
    pair = Pair(tiny_llama(), exact_cfg(prefill_exact_tokens=4096, cold_codec=codec))
    pair.check(torch.randint(0, 128, (1, 90)))
    pair.check(torch.randint(0, 128, (1, 6)))  # a draft: still the exact prompt
    layer = flash_layers(pair.cache)[0]
    assert layer.exact_prompt(5) and layer.exact.streamed == (codec == "exact")
    assert (layer.exact.nbytes() > 0) == (codec == "int8")
    pair.both("crop", 0)
    assert not layer.exact_prompt(5) and layer.exact.nbytes() == 0
    assert pair.cache.memory_report()["tiers"]["prefill_kv"] == 0
    if codec == "exact":
        for draft, reject in [(5, 3), (8, 8), (3, 0)]:
            pair.check(torch.randint(0, 128, (1, draft)))
            pair.both("crop", -reject)


def fed(model, cfg: flashmem.FlashMemoryConfig, ids: torch.Tensor):
    """A cache that was fed ids [1, n] in one forward (the tiers a crop must give back)."""
    cache = flashmem.attach(model, cfg)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


def assert_same_tiers(cache, other) -> None:
    """The layers hold the same tokens in the same tiers: sinks, sealed blocks (their count, index
    pages, HCA entries, the rest entry's value sum), open block and window."""
    for a, b in zip(cache.flash_layers, other.flash_layers, strict=True):
        assert (a.sealed, a.tokens_seen) == (b.sealed, b.tokens_seen)
        for name in ("sink_k", "sink_v", "open_k", "open_v", "win_k", "win_v", "v_sum"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape and torch.allclose(x, y, atol=1e-5), name
        assert a.index.count == b.index.count and a.summaries.hca_k.shape == b.summaries.hca_k.shape
        assert torch.allclose(a.index.read(torch.float32), b.index.read(torch.float32), atol=0.05)
        assert torch.equal(a.valid, b.valid)


@pytest.mark.parametrize("tier", ["memory", "disk+prefetch"])
def test_crop_into_sealed_history_unseals_blocks_and_equals_dynamic_cache(tier, tmp_path):
    """A crop past the window and the open block brings the newest sealed blocks back from the
    cold tier into the open block, then seals what the kept tokens fill: the layers hold what a
    cache fed only the kept tokens holds, and decode as DynamicCache does."""
    torch.manual_seed(2)
    model = tiny_llama()
    pair = Pair(model, exact_cfg(**cold_tiers(tmp_path)[tier]))
    seq = torch.randint(0, 128, (1, 100))
    pair.check(seq)
    layer = flash_layers(pair.cache)[0]
    unsealed = 0
    for draft, reject in [(40, 40), (30, 45), (20, 60), (8, 1), (5, 50)]:
        ids = torch.randint(0, 128, (1, draft))
        pair.check(ids)
        sealed_before = layer.sealed
        tail = layer.win_k.shape[-2] + layer.open_k.shape[-2]
        pair.both("crop", -reject)
        seq = torch.cat([seq, ids], dim=-1)[:, : seq.shape[1] + draft - reject]
        unsealed += reject > tail
        assert layer.sealed == max(0, seq.shape[1] - 2 - 32) // 16 and layer.sealed <= sealed_before
        assert_same_tiers(pair.cache, fed(model, exact_cfg(), seq))
        more = torch.randint(0, 128, (1, 3))
        pair.check(more)
        seq = torch.cat([seq, more], dim=-1)
    assert unsealed >= 3


@pytest.mark.parametrize("variant", ["default", "static"])
def test_crop_after_unsealing_decodes_as_a_cache_fed_the_kept_tokens(variant):
    """The recipe (pages re-ranked by the CPU's int8 key copy, an int8 working set, the rest
    entry), and the static decode step (a segment's buffers): a draft that sealed blocks,
    rejected past them, leaves the cache in the state of one that never saw it, so the next
    steps' logits are that cache's."""
    torch.manual_seed(5)
    model = tiny_llama()
    cfg = flashmem.FlashMemoryConfig.for_budget(1 / 8, 2048, model, variant=variant)
    assert cfg.gpu_cache_limit == 8
    if variant == "default":
        assert cfg.keeps_rest_entry and cfg.lsa_rerank_mirror == "int8"
    else:
        assert cfg.decode_step == "static"
    seq = torch.randint(0, 128, (1, 1500))
    cache = fed(model, cfg, seq)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 1)), cache=cache, use_cache=True)  # a decode step: pages selected
        draft = torch.randint(0, 128, (1, 90))
        model(draft, cache=cache, use_cache=True)
    layer = cache.flash_layers[0]
    sealed, tail = layer.sealed, layer.win_k.shape[-2] + layer.open_k.shape[-2]
    cache.crop(-(tail + 70))
    assert layer.sealed < sealed
    kept = cache.get_seq_length()
    ref = fed(model, cfg, torch.cat([seq, torch.zeros(1, 1, dtype=torch.long), draft], dim=-1)[:, :kept])
    # the decode step after the prompt and the kept draft tokens: both caches hold the same tokens
    assert_same_tiers(cache, ref)
    with torch.no_grad():
        for tok in torch.randint(0, 128, (4, 1, 1)):
            a = model(tok, cache=cache, use_cache=True).logits
            b = model(tok, cache=ref, use_cache=True).logits
            assert (a - b).abs().max() <= 1e-4
    assert (layer.static_steps > 1) == (variant == "static")  # the segment before the draft and after the crop


def test_a_crop_the_layers_cannot_make_is_refused_and_changes_nothing():
    torch.manual_seed(2)
    pair = Pair(tiny_llama(), exact_cfg(cold_codec="int8"))  # coded blocks cannot come back as they came
    pair.forward(torch.randint(0, 128, (1, 100)))  # (int8 blocks: not DynamicCache's logits)
    layer = flash_layers(pair.cache)[0]
    room = generation.croppable_tokens(layer)
    assert room == layer.win_k.shape[-2] + layer.open_k.shape[-2] >= 32
    seen = pair.cache.get_seq_length()
    with pytest.raises(
        FlashMemError, match=rf"crop of {room + 1} tokens reaches into sealed history.*cold_codec: int8.*at most {room}"
    ):
        pair.cache.crop(-(room + 1))
    assert [lay.get_seq_length() for lay in pair.cache.layers] == [seen, seen]  # all or nothing
    with pytest.raises(FlashMemError, match=r"crop\(3\): a positive count is not allowed"):
        pair.cache.crop(3)
    pair.both("crop", -room)  # the whole exact tail is allowed
    assert layer.win_k.shape[-2] == layer.open_k.shape[-2] == 0
    pair.forward(torch.randint(0, 128, (1, 3)))  # (int8 blocks: not DynamicCache's logits)
    exact = Pair(tiny_llama(), exact_cfg())
    exact.check(torch.randint(0, 128, (1, 50)))
    with pytest.raises(
        FlashMemError, match=r"crop of 51 tokens is more than layer 0 holds \(50\); allowed: at most 50"
    ):
        exact.cache.crop(-51)
    exact.both("crop", -50)


def test_crop_before_anything_is_sealed_reaches_the_sinks():
    pair = Pair(tiny_llama(), exact_cfg())
    pair.check(torch.randint(0, 128, (1, 10)))
    pair.both("crop", -9)  # 8 window tokens and one of the 2 sinks
    assert flash_layers(pair.cache)[0].sink_k.shape[-2] == 1
    pair.check(torch.randint(0, 128, (1, 40)))


def _count_crops(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = generation.crop

    def spy(layer, n, *rest):
        seen.append(n)
        return real(layer, n, *rest)

    monkeypatch.setattr(generation, "crop", spy)
    return seen


def _reference(model, ids, **kw) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    return model.generate(ids, cache=DynamicCache(config=model.config), **kw)


def test_assisted_generation_equals_dynamic_cache(monkeypatch):
    """A tiny target and a tiny draft model of the same vocabulary; the draft proposes 6
    tokens at a time, the target verifies them through flashmem and crops the rejected."""
    torch.manual_seed(3)
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    ids = torch.randint(0, 128, (1, 70))
    kw = dict(GEN, max_new_tokens=40, assistant_model=draft)
    draft.generation_config.num_assistant_tokens = 6
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    ref = _reference(target, ids, **kw)
    crops = _count_crops(monkeypatch)
    out = target.generate(ids, cache=flashmem.attach(target, exact_cfg()), **kw)
    assert torch.equal(out, ref)
    assert torch.equal(out, _reference(target, ids, **GEN, max_new_tokens=40))  # greedy's tokens
    assert any(n <= -5 for n in crops), crops  # whole drafts were rejected and cropped


def test_assisted_generation_with_the_recipe_unseals_past_a_short_window(monkeypatch):
    """The recipe at 1/16 of a short prompt sizes an 8-token window: a 20-token draft rejected
    right after a seal reaches into sealed history, and the crop unseals the blocks the draft
    sealed (read back from the cold tier), so generation runs through seals and crops."""
    torch.manual_seed(3)
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    ids = torch.randint(0, 128, (1, 600))
    draft.generation_config.num_assistant_tokens = 20
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    kw = dict(GEN, max_new_tokens=120, assistant_model=draft)
    cache = flashmem.attach(target, budget=1 / 16, tokens=700)
    assert cache.flash_layers[0].cfg.gpu_cache_limit == 8
    crops = _count_crops(monkeypatch)
    unseals: list[int] = []
    real = generation.unseal

    def spy(layer, blocks):
        unseals.append(sum(bk.shape[-2] for bk, _ in blocks))
        return real(layer, blocks)

    monkeypatch.setattr(generation, "unseal", spy)
    out = target.generate(ids, cache=cache, **kw)
    assert out.shape[1] == 720 and cache.flash_layers[0].num_sealed > 8  # blocks sealed while drafting
    assert min(crops) <= -16  # drafts were rejected whole or nearly, past the 8 tokens the window holds
    assert unseals and all(n % 64 == 0 for n in unseals)  # whole blocks came back
    # each verified token selected as a one-token step does: plain decoding's tokens (an end-to-end
    # check; on this random model a shared selection gives them too: the verify test below tells
    # the two apart)
    greedy = target.generate(ids, cache=flashmem.attach(target, budget=1 / 16, tokens=700), **GEN, max_new_tokens=120)
    assert torch.equal(out, greedy)


def _recipe_after_prompt(model, prompt: torch.Tensor, end: str, **extra):
    """The recipe at 1/16 with `prompt` fed, then the prompt ended as decoding ends it: one
    decoded token ("step") or, as assisted generation does after its first verify forward, a
    crop of nothing ("crop")."""
    # exact_on_doubt off: the random model's every step is a near tie the CPU recipe would redo
    cache = flashmem.attach(model, budget=1 / 16, tokens=700, exact_on_doubt=0, **extra)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        if end == "step":
            model(prompt[:, -1:], cache=cache, use_cache=True)
        else:
            cache.crop(0)  # what transformers calls after a verify forward that kept its draft
    return cache


@pytest.mark.parametrize("end", ["step", "crop"])
@pytest.mark.parametrize("per_token", [True, False])
def test_a_verify_forward_selects_for_each_token_as_decoding_does(per_token, end):
    """A forward of 12 tokens after the prompt (a speculative verify) gives each token the
    logits of feeding the tokens one by one, selection included; with select_per_token_max 0
    the 12 share one selection and the logits differ (the check can tell the two apart)."""
    torch.manual_seed(5)
    model = tiny_llama(seed=0)
    prompt, draft = torch.randint(0, 128, (1, 600)), torch.randint(0, 128, (1, 12))
    extra = {} if per_token else {"select_per_token_max": 0}
    one_by_one = _recipe_after_prompt(model, prompt, end)
    verify = _recipe_after_prompt(model, prompt, end, **extra)
    assert verify.flash_layers[0].num_sealed > 0 and verify.flash_layers[0].cfg.lsa_top_k < 8  # it selects
    with torch.no_grad():
        ref = torch.cat([model(draft[:, i : i + 1], cache=one_by_one, use_cache=True).logits for i in range(12)], 1)
        got = model(draft, cache=verify, use_cache=True).logits
    gap = (got - ref).abs().max().item()
    assert gap <= 1e-5 if per_token else gap > 1e-4, gap  # 1.5e-7 and 6e-4 when written
    if per_token:  # and the caches hold the same tiers after it
        for a, b in zip(verify.flash_layers, one_by_one.flash_layers, strict=True):
            assert a.num_sealed == b.num_sealed and torch.allclose(a.win_k, b.win_k, atol=1e-5)


def test_prompt_lookup_decoding_equals_dynamic_cache(monkeypatch):
    torch.manual_seed(4)
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 12)).repeat(1, 6)  # repeats: the lookup finds drafts
    kw = dict(GEN, max_new_tokens=40, prompt_lookup_num_tokens=5)
    ref = _reference(model, ids, **kw)
    crops = _count_crops(monkeypatch)
    out = model.generate(ids, cache=flashmem.attach(model, exact_cfg()), **kw)
    assert torch.equal(out, ref)
    assert any(n < 0 for n in crops)


# ---------------------------------------------------------------------------- rows
def forget_working_sets(cache) -> None:
    """As a step that selects other pages: the next one reads every selected page from the
    cold tier again (an exact config selects the same pages each step, and the working set,
    whose rows move with the rows, would otherwise serve them all)."""
    for layer in flash_layers(cache):
        layer.working_set.clear()


@pytest.mark.parametrize("tier", ["memory", "disk+prefetch"])
def test_reorder_repeat_select_rows_equal_dynamic_cache(tier, tmp_path):
    """Rows of different histories reordered, repeated and selected; each later step reads
    the sealed blocks of the row it now continues (through the row map)."""
    torch.manual_seed(5)
    pair = Pair(tiny_llama(), exact_cfg(**cold_tiers(tmp_path)[tier]))
    pair.check(torch.randint(0, 128, (3, 100)))
    pair.both("reorder_cache", torch.tensor([2, 0, 0]))
    layer = flash_layers(pair.cache)[0]
    sealed_then = layer.sealed
    assert isinstance(layer.reader.store, RowMappedStore)
    if tier == "disk+prefetch":
        assert isinstance(layer.reader.prefetcher, RowMappedPrefetcher)
    for step in range(20):  # enough to seal more blocks in the new row order
        if step % 5 == 0:
            forget_working_sets(pair.cache)
        pair.check(torch.randint(0, 128, (3, 1)))
    pair.both("reorder_cache", torch.tensor([1, 2, 1]))  # composed with the first map
    if tier == "disk+prefetch":  # the prefetcher handed back keeps reading through the map
        pair.cache.use_prefetcher(False)
        pair.cache.use_prefetcher(True)
        assert isinstance(layer.reader.prefetcher, RowMappedPrefetcher)
    forget_working_sets(pair.cache)
    pair.check(torch.randint(0, 128, (3, 4)))
    pair.both("batch_repeat_interleave", 2)
    forget_working_sets(pair.cache)
    pair.check(torch.randint(0, 128, (6, 1)))
    pair.both("batch_select_indices", torch.tensor([5, 0]))
    for _ in range(18):
        forget_working_sets(pair.cache)
        pair.check(torch.randint(0, 128, (2, 1)))
    assert layer.sealed > sealed_then + 1  # blocks sealed in each row order are read back


def test_rows_change_during_a_streamed_exact_prompt():
    """An exact prompt streamed from the tiers (prefill_exact_tokens, exact cold tier) reads
    every sealed block each forward: after a row change it reads them through the row map."""
    torch.manual_seed(8)
    pair = Pair(tiny_llama(), exact_cfg(prefill_exact_tokens=4096))
    pair.check(torch.randint(0, 128, (3, 90)))
    assert flash_layers(pair.cache)[0].exact.streamed
    pair.both("reorder_cache", torch.tensor([1, 0, 1]))
    pair.check(torch.randint(0, 128, (3, 20)))
    pair.both("batch_select_indices", torch.tensor([False, True, True]))
    pair.check(torch.randint(0, 128, (2, 20)))


@pytest.mark.parametrize("tier", ["memory", "disk+prefetch"])
@pytest.mark.parametrize("changes", [[[0]], [[1, 0], [1]]])
def test_rows_dropped_to_the_first_ones_read_only_theirs(tier, changes, tmp_path):
    """Keeping row 0 of two (alone, or after a swap that puts it first) maps each current row to
    its own stored row, which reads like no map at all, except that the blocks hold rows that
    were dropped: reads must still pick the kept row."""
    torch.manual_seed(6)
    pair = Pair(tiny_llama(), exact_cfg(**cold_tiers(tmp_path)[tier]))
    pair.check(torch.randint(0, 128, (2, 100)))
    for rows in changes:
        pair.both("reorder_cache" if len(rows) == 2 else "batch_select_indices", torch.tensor(rows))
    forget_working_sets(pair.cache)
    for _ in range(4):
        pair.check(torch.randint(0, 128, (1, 1)))


def test_identity_reorder_keeps_the_fast_reads():
    pair = Pair(tiny_llama(), exact_cfg())
    pair.check(torch.randint(0, 128, (2, 60)))
    pair.both("reorder_cache", torch.tensor([0, 1]))
    assert not isinstance(flash_layers(pair.cache)[0].reader.store, RowMappedStore)
    pair.check(torch.randint(0, 128, (2, 1)))


def test_rows_out_of_range_are_refused():
    pair = Pair(tiny_llama(), exact_cfg())
    pair.check(torch.randint(0, 128, (2, 40)))
    with pytest.raises(FlashMemError, match=r"batch rows \[0, 2\] do not fit the cache's 2 rows"):
        pair.cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(FlashMemError, match=r"batch_repeat_interleave\(0\)"):
        pair.cache.batch_repeat_interleave(0)


def test_reset_after_beams_reads_the_new_sequence_as_stored():
    model = tiny_llama()
    cache = flashmem.attach(model, exact_cfg())
    ids = torch.randint(0, 128, (1, 60))
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 80)), cache=cache, use_cache=True)
        cache.reorder_cache(torch.tensor([1, 1]))
        cache.reset()
        out = model(ids, cache=cache, use_cache=True).logits
        nxt = model(ids[:, :5], cache=cache, use_cache=True).logits
    pair = Pair(model, exact_cfg())
    ref_out, ref_nxt = pair.forward(ids)[1], pair.forward(ids[:, :5])[1]
    assert (out - ref_out).abs().max() <= 1e-4 and (nxt - ref_nxt).abs().max() <= 1e-4


@pytest.mark.parametrize("beams", [2, 3, 4])
def test_beam_search_equals_dynamic_cache(beams):
    torch.manual_seed(6)
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 80))
    kw = dict(GEN, max_new_tokens=30, num_beams=beams, num_return_sequences=min(beams, 2))
    ref = _reference(model, ids, **kw)
    cache = flashmem.attach(model, exact_cfg())
    out = model.generate(ids, cache=cache, **kw)
    assert torch.equal(out, ref)
    assert isinstance(flash_layers(cache)[0].reader.store, RowMappedStore)  # beams did diverge


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("mode", ["beams", "lookup", "beams, a plain full layer"])
def test_each_architecture_with_beams_and_lookup_equals_dynamic_cache(arch, mode):
    """Gemma3's sliding layers and keep_full_layers' plain layers crop and reorder themselves
    (transformers' own layers) beside the FlashLayers."""
    model = MODELS[arch]()
    torch.manual_seed(9)
    ids = torch.randint(0, 128, (1, 12)).repeat(1, 6)
    kw = dict(GEN, max_new_tokens=30, **({"prompt_lookup_num_tokens": 4} if mode == "lookup" else {"num_beams": 3}))
    cfg = exact_cfg(keep_full_layers=[1]) if "full" in mode else exact_cfg()
    ref = _reference(model, ids, **kw)
    assert torch.equal(model.generate(ids, cache=flashmem.attach(model, cfg), **kw), ref)


def test_sampling_with_several_return_sequences_equals_dynamic_cache():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 50))
    kw = dict(do_sample=True, max_new_tokens=25, num_return_sequences=3, pad_token_id=0)
    torch.manual_seed(7)
    ref = _reference(model, ids, **kw)
    torch.manual_seed(7)
    out = model.generate(ids, cache=flashmem.attach(model, exact_cfg()), **kw)
    assert out.shape[0] == 6 and torch.equal(out, ref)


# ---------------------------------------------------------------------------- cache_implementation
def test_cache_implementation_name_builds_a_flashmem_cache():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 60))
    ref = _reference(model, ids, **GEN, max_new_tokens=20)
    flashmem.register()
    out = model.generate(
        ids,
        cache_implementation="flashmem",
        cache_config=exact_cfg(),
        return_dict_in_generate=True,
        **GEN,
        max_new_tokens=20,
    )
    assert type(out.past_key_values).__name__ == "FlashMemoryCache"
    assert out.past_key_values.flash_layers[0].sealed > 0
    assert torch.equal(out.sequences, ref)
    # other names are transformers' own
    model.set_attn_implementation("sdpa")
    dyn = model.generate(ids, cache_implementation="dynamic", return_dict_in_generate=True, **GEN, max_new_tokens=5)
    assert type(dyn.past_key_values) is DynamicCache


def test_cache_implementation_rejects_a_bad_cache_config():
    flashmem.register()
    model = tiny_llama()
    with pytest.raises(FlashMemError, match="cache_config: a int is not allowed"):
        model.generate(torch.randint(0, 128, (1, 8)), cache_implementation="flashmem", cache_config=3, **GEN)
