"""A decode step that keeps the number of selected pages writes only the pages that came in,
into the slots of those that left (cache/working_set.py `_merge_in_place`)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache.working_set import WorkingSet
from test_cache import SMALL
from tiny_models import tiny_llama

torch.set_num_threads(1)

PAGED = dict(SMALL, use_summaries=False, lsa_top_k=5, lsa_page_tokens=4, prefetch_threads=0)


def _by_page(ws: WorkingSet) -> list[torch.Tensor]:
    """The working set's held rows (K and V; int8: codes and scales) sorted by page id, so
    two sets holding the same pages in other slots compare equal."""
    assert ws.idx is not None
    b, h, k = ws.idx.shape
    order = ws.idx.argsort(-1)
    out = []
    for code in ws.code:
        assert code is not None
        for t in code:
            pages = t.reshape(b, h, k, -1)
            out.append(pages.gather(2, order[..., None].expand_as(pages)))
    return out


def _run(in_place: bool, codec: str, cache_pages: int, steps: int = 24):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 120 + steps), generator=torch.Generator().manual_seed(5))
    cfg = flashmem.FlashMemoryConfig(**PAGED, working_set_codec=codec, lsa_cache_pages=cache_pages)
    logits, held, moved = [], [], []
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        logits.append(model(ids[:, :120], cache=cache, use_cache=True).logits[:, -1])
        for layer in cache.flash_layers:
            layer.working_set.in_place = in_place
        for t in range(120, 120 + steps):
            ws = cache.flash_layers[0].working_set
            before = None if ws.code[0] is None else (ws.code[0][0].data_ptr(), ws.idx.sort(-1).values.clone())
            logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
            held.append([_by_page(layer.working_set) for layer in cache.flash_layers])
            if before is not None and ws.idx.shape[-1] == before[1].shape[-1]:
                changed = not torch.equal(ws.idx.sort(-1).values, before[1])
                moved.append((changed, ws.code[0][0].data_ptr() == before[0]))
    return torch.cat(logits), held, moved


@pytest.mark.parametrize("codec, cache_pages", [("int8", 0), ("model", 0), ("int8", 3)])
def test_in_place_holds_what_a_rebuild_holds(codec, cache_pages):
    """Every step the in-place working set holds the same pages with the same rows (int8: the
    same codes) as one rebuilt in page order, the logits agree to float rounding (the keys sit
    in another order), and a step whose selection changed wrote into the tensors it held."""
    ref, ref_held, _ = _run(False, codec, cache_pages)
    got, got_held, moved = _run(True, codec, cache_pages)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for step_ref, step_got in zip(ref_held, got_held, strict=True):
        for layer_ref, layer_got in zip(step_ref, step_got, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(layer_ref, layer_got, strict=True))
    changed = [same_storage for was_changed, same_storage in moved if was_changed]
    assert changed and all(changed)  # a changed selection of as many pages was written in place


def test_an_in_place_step_copies_only_the_pages_that_came_in(monkeypatch):
    """Counted: an in-place step copies as many page rows as pages came in (from the cold tier
    or the spare slots), not the whole set."""
    copied: list[int] = []
    real = torch.Tensor.index_copy_

    def counting(self, dim, index, source):
        copied.append(index.numel())
        return real(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", counting)
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(5))
    cfg = flashmem.FlashMemoryConfig(**PAGED, working_set_codec="int8")
    checked = 0
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        model(ids[:, :120], cache=cache, use_cache=True)
        layers = cache.flash_layers
        for t in range(120, 150):
            prev = [None if layer.ws_idx is None else layer.ws_idx.clone() for layer in layers]
            copied.clear()
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
            new_pages = 0
            for layer, p in zip(layers, prev, strict=True):
                if p is not None and p.shape == layer.ws_idx.shape:
                    new_pages += int((~(layer.ws_idx[..., :, None] == p[..., None, :]).any(-1)).sum())
            if all(p is not None and p.shape == layer.ws_idx.shape for layer, p in zip(layers, prev, strict=True)):
                # K codes, K scales, V codes, V scales: one write each of the new pages' rows
                assert sum(copied) == 4 * new_pages
                checked += new_pages > 0
    assert checked >= 3  # steps that brought pages in, in place
