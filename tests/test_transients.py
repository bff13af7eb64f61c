"""What a step holds for a moment does not grow with the context: the bytes of tensors alive at
once, counted on the CPU as `torch.cuda.max_memory_allocated` would count them on a GPU
(flashmem_eval/live_bytes.py). The first H200 run found two that did (docs/accelerator.md,
"The first run on an H200")."""

from __future__ import annotations

import types

import pytest
import torch

import flashmem
from flashmem.cache import assembly
from flashmem.cache.scratch import thread_scratch
from flashmem.index import selection
from flashmem.store.memory import MemoryStore
from flashmem_eval.live_bytes import LiveBytes
from test_cache import SMALL, run
from tiny_models import tiny_llama

# every prompt chunk selects (no exact prompt): its queries score every page
SELECTING = dict(SMALL, prefill_chunk=256, prefill_exact_tokens=0, lsa_top_k=4, lsa_page_tokens=4)


# ... and keeps a rest entry, which needs every query's scores
RESTING = dict(SELECTING, use_summaries=False, rest_entry=True)


def _prompt_transient(tokens: int, keys: dict | None = None) -> int:
    """Peak live bytes over what is live when the prompt is in (the cache's state), for a
    prompt of `tokens` fed in 256-token chunks; the cold tier (host memory on a GPU) left out.
    The thread's attention buffers start empty, so each prompt counts its own."""
    thread_scratch().clear()
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**(keys or SELECTING)))
    with torch.no_grad(), LiveBytes(exclude=("store.",)) as live:
        flashmem.prefill(model, cache, ids, chunk=256)
    cache.close()
    return live.peak - live.live


def test_a_prompt_chunks_index_scores_do_not_grow_with_the_context(monkeypatch):
    # blocks of 256 KiB of scores; a 4,096-token prompt's last chunk scores 1,016 pages with
    # 512 grouped queries: 4 MiB whole, per temporary. The mask of the chunk's attention, over
    # an HCA entry per sealed block, is capped as at real sizes (64 MiB there)
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES", 256 << 10)
    monkeypatch.setattr(assembly, "MASK_BYTES", 256 << 10)
    short, long = _prompt_transient(1024), _prompt_transient(4096)
    assert long <= 1.5 * short, (short, long)
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES", 1 << 40)  # scored whole, as before
    assert _prompt_transient(4096) > 2 * long  # what the blocks keep out


def test_on_a_cpu_a_prompt_chunks_transients_are_held_to_the_cpus_bound(monkeypatch):
    """MASK_BYTES and SCORE_BLOCK_BYTES left at their accelerator sizes (64 MiB): on a CPU the
    mask and the index scores are held to its own bound instead (here 256 KiB), so the
    transient does not grow with the context; without that bound it does."""
    from flashmem.cache import scratch

    monkeypatch.setattr(scratch, "CPU_TRANSIENT_BYTES", 256 << 10)
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES_CPU", 256 << 10)
    short, long = _prompt_transient(1024), _prompt_transient(4096)
    assert long <= 1.5 * short, (short, long)
    monkeypatch.setattr(scratch, "CPU_TRANSIENT_BYTES", 1 << 40)
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES_CPU", 1 << 40)
    assert _prompt_transient(4096) > 2 * long
    assert scratch.transient_cap(64 << 20, torch.device("meta")) == 64 << 20  # elsewhere: as is


def test_a_prompt_chunks_rest_entry_scores_in_blocks_with_the_same_logits(monkeypatch):
    """A rest entry reads every query's index scores. A prompt chunk's, past their bound, are
    scored again a block at a time instead of held whole (as its selection pools them): the
    same logits, and a transient that does not grow with the context where whole it does."""
    from flashmem.cache import tiered_attention

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 1024), generator=torch.Generator().manual_seed(4))
    cfg = flashmem.FlashMemoryConfig(**RESTING)
    whole = run(model, flashmem.attach(model, cfg), ids, 4)
    blocks = []
    real = tiered_attention._score_blocks
    monkeypatch.setattr(tiered_attention, "_score_blocks", lambda *a: blocks.append(1) or real(*a))
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES_CPU", 64 << 10)
    in_blocks = run(model, flashmem.attach(model, cfg), ids, 4)
    assert blocks  # the prompt's later chunks scored in blocks
    assert (in_blocks - whole).abs().max() <= 1e-4
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES_CPU", 256 << 10)
    short, long = _prompt_transient(1024, RESTING), _prompt_transient(4096, RESTING)
    assert long <= 1.5 * short, (short, long)
    monkeypatch.setattr(selection, "SCORE_BLOCK_BYTES_CPU", 1 << 40)  # held whole, as before
    assert _prompt_transient(4096, RESTING) > 2 * long


def test_the_memory_tier_keeps_one_arena_per_layer_as_it_grows():
    """Blocks point into the grown arena, so the earlier ones are freed: 5.5x the blocks'
    bytes were held before (each growth a quarter more, every generation kept by views)."""
    k = torch.randn(1, 2, 16, 8)
    with LiveBytes() as live:
        store = MemoryStore()
        for j in range(1000):
            store.put((0, j), k, k + 1)
    data = 1000 * 2 * k.nbytes
    assert data <= live.live <= 1.3 * data
    assert torch.equal(store.get((0, 3))[1], k + 1) and torch.equal(store.get((0, 999))[0], k)
    store.close()


def test_the_index_mass_of_a_score_block_holds_two_copies_beside_it():
    """A prompt chunk's pooled mass from a block of scores [b, h, nq, n] (up to SCORE_BLOCK_BYTES):
    the logits and their softmax beside the scores, the masking and the zeroed rows in place (it
    held three copies before); the same mass as the out-of-place formula."""
    scores = torch.randn(1, 4, 256, 1024, generator=torch.Generator().manual_seed(0))
    valid = torch.rand(1, 1024, generator=torch.Generator().manual_seed(1)) > 0.2
    with LiveBytes() as live:
        mass = selection.index_mass(scores, valid, 0.125)
    assert live.peak <= 2 * scores.nbytes + 64 * 1024, live.peak / scores.nbytes
    logits = (scores * 0.125).masked_fill(~valid[:, None, None, :], float("-inf"))
    assert torch.equal(mass, torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=-2))


@pytest.mark.parametrize("codec", ["int8", "model"])
def test_a_working_set_whose_page_count_changes_holds_the_old_set_and_the_new_one(codec):
    """A step whose page count changes rebuilds the working set (cache/working_set.py `merge`):
    the kept rows gathered from the old set, the new pages copied in, so what it makes is the new
    set and the new pages' rows, not also a concatenation of the old set and the new pages. The
    kept pages' rows are the old set's."""
    from flashmem.cache.working_set import WorkingSet
    from flashmem.compress import page_code

    g = torch.Generator().manual_seed(0)
    b, h, k, P, d = 1, 2, 200, 4, 16
    ws = WorkingSet(codec, P, torch.float32, in_place=False)
    idx = torch.arange(0, 2 * k, 2).expand(b, h, k).contiguous()  # even pages
    pages = torch.randn(b, h, k, P, d, generator=g), torch.randn(b, h, k, P, d, generator=g)
    valid = torch.ones(b, 2 * k + 2, P, dtype=torch.bool)
    ws.set(idx, *pages, valid)
    # one page fewer: the first 3 leave, 2 odd pages come in
    new_idx = torch.cat([idx[..., 3:], torch.tensor([1, 3]).expand(b, h, 2)], -1).sort(-1).values
    held = ws.held_over(new_idx, types.SimpleNamespace(latent=None))  # type: ignore[arg-type]
    assert held is not None
    n_new = int((~held[0]).sum())
    fresh = torch.randn(n_new, P, d, generator=g), torch.randn(n_new, P, d, generator=g)
    with LiveBytes() as live:
        ws.merge(new_idx, held, *fresh, valid)
    made = sum(t.nbytes for code in ws.code for t in code)  # the new set's rows, as held
    # the new pages' coding and the row indices beside it (1.19x int8, 1.06x the model's dtype;
    # 1.42x and 1.54x with the concatenation)
    assert live.peak <= 1.25 * made, (live.peak, made)
    # each page's rows: a kept page's as the old set held them, a new page's the fresh ones (coded
    # as the set codes them), in the new selection's order
    ref = WorkingSet(codec, P, torch.float32, in_place=False)
    ref.set(idx, *pages, valid)
    keep, src = held[0].reshape(b * h, -1), held[1].reshape(b * h, -1)
    for slot, new in enumerate(fresh):
        got, old = ws.code[slot], ref.code[slot]
        assert got is not None and old is not None
        coded = (new,) if codec == "model" else page_code.encode(new)
        for part, was, came in zip(got, old, coded, strict=True):
            rows, was = part.reshape(b * h, k - 1, -1), was.reshape(b * h, k, -1)
            came = iter(came.reshape(n_new, -1))
            for i in range(b * h):
                for j in range(k - 1):
                    want = was[i, src[i, j]] if keep[i, j] else next(came)
                    assert torch.equal(rows[i, j], want)


@pytest.mark.parametrize("chunk", [37, 256])
def test_the_open_block_and_window_do_not_keep_the_chunk_they_were_cut_from(chunk):
    """After a seal the open block and the window are copied out of the chunk they were appended
    with: as views they kept that chunk's whole K/V alive in every layer until its next append
    (SmolLM2 at 8K: 23 MiB when the prompt is in, 2x a 1/32 budget). Their storage is what they
    hold, and `memory_report()` counts it."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(0))
    cfg = flashmem.FlashMemoryConfig(
        **dict(SMALL, prefill_exact_tokens=4096, prefill_chunk=chunk)
    )  # the recipe's prompt
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        flashmem.prefill(model, cache, ids, chunk=chunk)
        for layer in cache.flash_layers:
            ks, vs = layer.tail_parts()
            held = sum(t.nbytes for t in ks + vs)
            storage = sum(t.untyped_storage().nbytes() for t in ks + vs)
            assert held > 0 and storage == held, (layer.layer_idx, storage, held)
            open_b, window_b = layer._tail_bytes()
            assert open_b + window_b == held
        model(ids[:, -1:], cache=cache, use_cache=True)  # a decode step after it reads them as before


def _held_tensors(obj, path: str = "layer", depth: int = 0, seen: set | None = None):
    """(path, tensor) for every tensor a layer's own objects hold (its store and reader, which
    share the cold tier's arena by design, left out)."""
    seen = set() if seen is None else seen
    if depth > 5 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, list | tuple):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("flashmem"):
        items = list(vars(obj).items())
    else:
        return
    for k, v in items:
        if k not in ("store", "reader", "prefetcher"):
            yield from _held_tensors(v, f"{path}.{k}", depth + 1, seen)


def test_no_tensor_a_layer_holds_keeps_a_larger_one_alive():
    """Every tensor a layer keeps (its tiers, index, working set, bookkeeping) owns its storage,
    within a little room: a view of something larger keeps bytes `memory_report()` does not see
    (stop 68: the open block and window kept each prompt chunk's K/V)."""
    model = tiny_llama()
    cfg = flashmem.FlashMemoryConfig.for_budget(1 / 8, 2048, model)
    ids = torch.randint(0, 128, (1, 2000), generator=torch.Generator().manual_seed(0))
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        nxt = flashmem.prefill(model, cache, ids, chunk=512)[:, -1:].argmax(-1)
        for step in range(4):
            for layer in cache.flash_layers:
                pinned = [
                    (path, t.nbytes, t.untyped_storage().nbytes())
                    for path, t in _held_tensors(layer)
                    if t.untyped_storage().nbytes() > 1.25 * t.nbytes + 4096
                ]
                assert not pinned, (step, pinned[:3])
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
