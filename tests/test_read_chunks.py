"""Large reads of a step in chunks (`BlockReader.read_chunk_bytes`): on a CPU with a disk tier the
re-rank's candidates' keys (`CandidateRanker._rerank_streamed`) and an int8 working set's new
pages (`WorkingSet._coded_in_chunks`) are read a chunk at a time, choose and attend what one whole
read does, and no chunk is larger than the bound. A memory tier on a CPU reads them whole (they
lie in the same RAM)."""

from __future__ import annotations

import pytest
import torch

import flashmem
from flashmem.cache import block_reads
from flashmem.cache.block_reads import BlockReader
from test_traffic import RERANKED, _decode
from tiny_models import tiny_llama

# tiny_llama: 2 KV heads of 16, 4-token pages: a candidate's keys are 512 bytes (fp32), a page's
# K and V of one head 512 bytes. 24 candidates and 12 selected pages a layer and step.
BOUND = 2048


@pytest.mark.parametrize("store", ["disk", "memory"])
@pytest.mark.parametrize("codec", ["model", "int8"])
@pytest.mark.parametrize("on_host", [False, True])
def test_reads_in_chunks_choose_and_attend_what_one_read_does(monkeypatch, tmp_path, store, codec, on_host):
    model = tiny_llama()
    # 600 tokens: 24 candidates are under a third of the pages, so a memory store's arena is
    # read page by page too (not scored in place)
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(3))
    where = {"cold_store": "disk", "cold_dir": str(tmp_path / "cold")} if store == "disk" else {}
    cfg = flashmem.FlashMemoryConfig(**{**RERANKED, "working_set_codec": codec}, **where)
    if on_host:  # ranked where the cold tier lies (an accelerator's way), forced on the CPU
        monkeypatch.setattr(BlockReader, "rank_on_host", True)
    real = BlockReader.arena_pages
    reads: list[tuple[bool, bool, int]] = []  # keys, values, bytes returned

    def counted(self, idx, keys=True, values=True, **kw):
        got = real(self, idx, keys, values, **kw)
        if got is not None:
            reads.append((keys, values, sum(t.nbytes for t in got if t is not None)))
        return got

    monkeypatch.setattr(BlockReader, "arena_pages", counted)
    ref, ref_sel = _decode(model, flashmem.attach(model, cfg), ids, 6)
    whole = list(reads)
    reads.clear()
    monkeypatch.setattr(block_reads, "READ_CHUNK_BYTES", BOUND)
    out, sel = _decode(model, flashmem.attach(model, cfg), ids, 6)
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in zip(sel, ref_sel, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.sort(-1).values, y.sort(-1).values)
    assert max(n for k, v, n in whole if not v) > BOUND  # the candidates' keys (read alone), whole
    if store == "memory":
        assert reads == whole
        return
    assert max(n for k, v, n in reads if not v) <= BOUND  # ... in chunks of at most the bound
    if codec == "int8":  # the working set's new pages (K and V) too: the first step's are every page
        assert max(n for k, v, n in whole if v) > BOUND
        assert max(n for k, v, n in reads if v) <= BOUND
