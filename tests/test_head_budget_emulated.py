"""The per-head page split's emulation (benchmarks/diagnostics/head_budget_emulated.py),
whose measurements docs/results.md reports: an even split is the recipe itself, and an
uneven one attends the layer's h x k pages in all, not one more."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import flashmem
from flashmem.cache import tiered_attention
from test_cache import run
from test_every_page import RECIPE_LIKE
from tiny_models import tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / "head_budget_emulated.py"
spec = importlib.util.spec_from_file_location("head_budget_emulated", SCRIPT)
assert spec is not None and spec.loader is not None
hb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hb)

# 4 pages a head of 30 (120 tokens of 4-token pages): a re-rank of 16 candidates scored in place
CFG = dict(RECIPE_LIKE, lsa_top_k=4, lsa_open_room=False)
IDS = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(3))


def test_an_even_split_is_the_recipe():
    model = tiny_llama().double()
    cfg = flashmem.FlashMemoryConfig(**CFG)
    ref = run(model, flashmem.attach(model, cfg), IDS, 20)
    undo = hb.patch(1.0, 1.0)
    try:
        out = run(model, flashmem.attach(model, cfg), IDS, 20)
    finally:
        undo()
    assert torch.equal(out, ref)


def test_an_uneven_split_attends_the_layers_pages_and_no_more():
    model = tiny_llama().double()
    cfg = flashmem.FlashMemoryConfig(**CFG)
    attended: list[tuple[int, int]] = []  # (pages whose tokens attention sees, h x k) per selection
    real = tiered_attention._add_working_set

    def count(layer, asm):
        ws = layer.working_set
        P = cfg.page_tokens
        pages = int(ws.valid.view(*ws.valid.shape[:2], -1, P).any(-1).sum())
        attended.append((pages, ws.idx.shape[1] * cfg.lsa_top_k))
        return real(layer, asm)

    hb.STATS["max_share"].clear()
    undo = hb.patch(2.0, 0.25)
    tiered_attention._add_working_set = count
    try:
        out = run(model, flashmem.attach(model, cfg), IDS, 20)
    finally:
        tiered_attention._add_working_set = real
        undo()
    assert attended and all(pages == total for pages, total in attended)
    assert max(hb.STATS["max_share"]) > 1.0  # some head took more than k: the split is not even
    ref = run(model, flashmem.attach(model, cfg), IDS, 20)
    assert not torch.equal(out, ref)
