"""`decode_step: static` (cache/static_step.py): the decode steps between two seals with fixed
shapes and no host reads give the eager step's logits, wait on nothing, trace whole under
torch.compile(fullgraph=True), and with `lsa_fetch_share` hold what they say they hold."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashmem
from flashmem.cache.static_step import StaticStep
from flashmem.errors import ConfigError
from test_cache import SMALL, run
from tiny_models import tiny_llama

torch.set_num_threads(1)

# 16-token blocks of 4-token pages, no summaries: what the static step supports
SRC = str(Path(flashmem.__file__).parent)  # flashmem's own code: its frames on a dispatch's stack
PAGED = dict(SMALL, use_summaries=False, lsa_top_k=5, lsa_page_tokens=4, prefill_exact_tokens=0, lsa_rerank=1)


class Spy:
    """Counts StaticStep segments and steps while patched in."""

    def __init__(self) -> None:
        self.segments = self.steps = self.reported = 0
        self.last: StaticStep | None = None
        real_init, real_run = StaticStep.__init__, StaticStep.run

        def init(step, layer):
            self.segments += 1
            self.last = step
            real_init(step, layer)

        def run_(step, *a, **k):
            self.steps += 1
            return real_run(step, *a, **k)

        self.patches = [mock.patch.object(StaticStep, "__init__", init), mock.patch.object(StaticStep, "run", run_)]

    def __enter__(self) -> Spy:
        for p in self.patches:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.patches:
            p.stop()


def _logits(step: str, ids, steps: int, mask=None, spy: Spy | None = None, **extra):
    model = tiny_llama()
    cfg = flashmem.FlashMemoryConfig(**{**PAGED, **extra}, decode_step=step)
    with flashmem.attach(model, cfg) as cache:
        out = run(model, cache, ids, steps, mask)
        if spy is not None:
            spy.reported = cache.memory_report()["static_decode_steps"]
        return out


@pytest.mark.parametrize("codec", ["int8", "model"])
@pytest.mark.parametrize("open_room", [True, False])
def test_static_steps_give_the_eager_steps_logits(codec, open_room):
    """Across several seals (each segment ends at one), with the working set coded or not. A
    segment holds its slots to its end, so it does not take lsa_open_room's extra pages: with it
    on, the static step gives the eager step's logits with it off."""
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    eager = _logits("eager", ids, 70, working_set_codec=codec, lsa_open_room=False)
    with Spy() as spy:
        static = _logits("static", ids, 70, spy=spy, working_set_codec=codec, lsa_open_room=open_room)
    assert spy.reported == spy.steps  # memory_report counts the static steps
    # 2 layers x 70 steps; the seal steps (one in 16) and the first of each segment differ
    assert spy.steps > 100 and 4 <= spy.segments < spy.steps / 5
    torch.testing.assert_close(static, eager, atol=2e-5, rtol=1e-4)


def test_static_steps_with_padded_rows_match_eager():
    """Two rows, the first left-padded: its padding stays hidden in the sinks and blocks."""
    ids = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[0, :7] = 0
    eager = _logits("eager", ids, 50, mask)
    with Spy() as spy:
        static = _logits("static", ids, 50, mask)
    assert spy.steps > 50
    torch.testing.assert_close(static, eager, atol=2e-5, rtol=1e-4)


# the re-rank the static step supports: the index's 3k candidates (at least 12), their keys' int4
# codes held on the device
RERANK = dict(lsa_rerank=3, lsa_rerank_codec="int4", lsa_rerank_on_device=True, lsa_rerank_min_pages=12)


@pytest.mark.parametrize("codec", ["int4", "sign"])
def test_static_steps_with_the_rerank_give_the_eager_steps_logits(codec):
    """The candidates' codes held in the ranker's slots, which the eager seal step updates in place
    between segments: the same candidates, scores and picks as the eager re-rank, across seals. The
    re-rank changes the logits (else this test could not tell it ran)."""
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(11))
    rr = dict(RERANK, lsa_rerank_codec=codec, lsa_open_room=False)
    eager = _logits("eager", ids, 70, **rr)
    with Spy() as spy:
        static = _logits("static", ids, 70, spy=spy, **rr)
    assert spy.last is not None and spy.last.rerank and spy.last.C > spy.last.k
    assert spy.steps > 100 and spy.reported == spy.steps
    torch.testing.assert_close(static, eager, atol=2e-5, rtol=1e-4)
    plain = _logits("eager", ids, 70, lsa_open_room=False)
    assert (plain - eager).abs().max() > 1e-3


def test_static_rerank_with_padded_rows_matches_eager():
    ids = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(12))
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[1, :5] = 0
    eager = _logits("eager", ids, 40, mask, **RERANK)
    static = _logits("static", ids, 40, mask, **RERANK)
    torch.testing.assert_close(static, eager, atol=2e-5, rtol=1e-4)


def test_fetch_cap_bounds_the_candidates_read_and_their_slots_hold_the_arenas_codes():
    """With lsa_fetch_share 0.25 at most as many candidate slots as pages (ceil(k / 4)) change a
    step per KV head, every held slot's codes are the host arena's for the page it names, and the
    candidates' link bytes are that fixed read's."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(13))
    cfg = flashmem.FlashMemoryConfig(
        **{**PAGED, **RERANK}, decode_step="static", lsa_fetch_share=0.25, working_set_codec="int8"
    )
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        layer = cache.flash_layers[1]
        before = None
        changes = 0
        for t in range(12):
            model(torch.full((1, 1), t % 5 + 2), cache=cache, use_cache=True)
            step = layer.static
            assert step is not None and step.filled and step.rerank
            now = step.cidx.clone()
            if before is not None and before[0] is step:
                changed = (now != before[1]).sum(-1)
                assert int(changed.max()) <= step.cfetch == step.fetch < step.C
                changes += int(changed.sum())
            before = (step, now)
            arena = layer.ranker.codes
            ppb, (b, h, _) = step.ppb, now.shape
            on = now >= 0
            blk, pg = now.clamp_min(0) // ppb, now.clamp_min(0) % ppb
            bi, hi = torch.arange(b)[:, None, None], torch.arange(h)[None, :, None]
            want_q = arena.q.view(arena.q.shape[0], b, h, ppb, step.P, -1)[blk, bi, hi, pg]  # [b, h, S, P, w]
            assert torch.equal(step.cq[on], want_q[on])
            assert torch.equal(step.cs[on], arena.scale[blk, bi, hi][on])
        assert changes > 0  # candidates did change: the check above saw reads
        cache.traffic_report()
        model(torch.full((1, 1), 4), cache=cache, use_cache=True)
        cache.traffic_report()
        last = cache._traffic.steps[-1]
    steps = [lay.static for lay in cache.flash_layers]
    b, h = steps[0].rows
    d, P = cache.flash_layers[0].sink_k.shape[-1], cfg.page_tokens
    pages = sum(b * h * s.fetch * 2 * P * (d + 4) for s in steps)  # int8 pages: codes and a scale a token
    codes = sum(b * h * s.cfetch * (P * d // 2 + 2 * d * 2) for s in steps)  # int4 keys, fp16 zero and scale
    assert last.counts["h2d_bytes"] == pages + codes
    assert last.candidate_hits + last.candidate_misses == sum(b * h * s.C for s in steps)


class Waits(TorchDispatchMode):
    """Operators whose result the host reads: it waits for the device's queue there."""

    NAMES = ("_local_scalar_dense", "nonzero", "unique", "_unique", "is_nonzero", "equal", "masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.kernels = 0  # flashmem's own: dispatched from its code, not the model's layers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else ()) or ()
        )
        self.waits += name.startswith(self.NAMES) or bool_index
        self.kernels += not func.is_view and _from_flashmem()
        return func(*args, **(kwargs or {}))


def _from_flashmem() -> bool:
    """Whether the operator being dispatched was called from flashmem's code (a frame of its
    package on the stack), not from the model's own layers, which both steps run alike."""
    f = sys._getframe(2)
    while f is not None:
        if SRC in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def _step_counts(step: str, **extra) -> tuple[int, int]:
    """Waits and kernels of one decode step in the middle of a segment (two layers)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    cfg = flashmem.FlashMemoryConfig(**{**PAGED, **extra}, decode_step=step)
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        tok = torch.full((1, 1), 5)
        for _ in range(3):  # the segment's first step (it reads every page) and one more
            model(tok, cache=cache, use_cache=True)
        with Waits() as w:
            model(tok, cache=cache, use_cache=True)
    return w.waits, w.kernels


def test_a_static_step_waits_on_nothing_and_launches_fewer_operators():
    eager_waits, eager_kernels = _step_counts("eager")
    static_waits, static_kernels = _step_counts("static")
    assert eager_waits > 0  # the count sees the eager step's host reads
    assert static_waits == 0
    assert static_kernels < 0.8 * eager_kernels
    # with the re-rank by codes held on the device: still no wait (the eager one waits)
    assert _step_counts("eager", **RERANK)[0] > eager_waits
    assert _step_counts("static", **RERANK, lsa_fetch_share=0.5)[0] == 0


@pytest.mark.parametrize("rerank", [False, True])
def test_device_step_traces_whole_and_gives_the_same_result(rerank):
    """torch.compile(fullgraph=True) refuses a graph break: a host read, a data-dependent shape,
    an unsupported out= write. The traced step equals the eager one, state updates included."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(5))
    extra = RERANK if rerank else {}
    cfg = flashmem.FlashMemoryConfig(**{**PAGED, **extra}, decode_step="static", lsa_fetch_share=0.4)
    seen: dict = {}
    real = StaticStep.device_step

    def keep(step, *a):
        if step.filled and "args" not in seen:
            seen["step"], seen["args"] = step, a[:-2] + (a[-2].clone(), a[-1].clone())
            seen["state"] = {
                k: v.clone() for k, v in vars(step).items() if isinstance(v, torch.Tensor) and not k.startswith("_")
            }
        return real(step, *a)

    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        with mock.patch.object(StaticStep, "device_step", keep):
            for _ in range(3):
                model(torch.full((1, 1), 5), cache=cache, use_cache=True)
        step, args = seen["step"], seen["args"]
        assert step.rerank is rerank
        assert args[6] is False  # a capped step: the fixed-size gather of new pages first

        def restore() -> None:
            for k, v in seen["state"].items():
                getattr(step, k).copy_(v)

        restore()
        want = real(step, *args)
        after = {k: getattr(step, k).clone() for k in seen["state"]}
        restore()
        got = torch.compile(step.device_step, fullgraph=True, backend="eager")(*args)
        torch._dynamo.reset()
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for k, v in after.items():
        assert torch.equal(getattr(step, k), v), k


def test_fetch_cap_reads_at_most_that_many_new_pages_and_holds_what_its_ids_say():
    """With lsa_fetch_share 0.2, each step brings at most a fifth of its pages per KV head into the
    working set; every slot holds the cold tier's page its id names (int8 rounding), and a step
    attends at most the pages its selection size allows."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(6))
    cfg = flashmem.FlashMemoryConfig(**PAGED, decode_step="static", lsa_fetch_share=0.2, working_set_codec="int8")
    with flashmem.attach(model, cfg) as cache, torch.no_grad(), Spy() as spy:
        model(ids, cache=cache, use_cache=True)
        layer = cache.flash_layers[0]
        before = None
        for t in range(12):
            model(torch.full((1, 1), t % 7 + 3), cache=cache, use_cache=True)
            step = spy.last if spy.last is not None and spy.last.layer is layer else layer.static
            assert step is not None and step.filled
            ids_now = step.ids.clone()
            if before is not None and before[0] is step:
                changed = (ids_now != before[1]).sum(-1)  # [b, h] slots whose page changed
                assert int(changed.max()) <= step.fetch < step.k
            before = (step, ids_now)
            b, h, k = ids_now.shape
            P, d = step.P, layer.sink_k.shape[-1]
            # the slots hold the host's codes of the pages their ids name, exactly
            codes = layer.page_codes.codes.view(-1, P * d)
            rows = (ids_now.div(step.ppb, rounding_mode="floor") * step.block_stride
                    + ids_now % step.ppb + step.page_base).view(-1)  # fmt: skip
            assert torch.equal(step.codes[0].view(b * h * k, P * d), codes[rows])
            # ... and those codes are the exact cold tier's pages, coded
            blocks = layer.store.block_run(layer.layer_idx, 0, layer.num_sealed)[0]
            exact = blocks.view(-1, P, d)[
                rows - ids_now.div(step.ppb, rounding_mode="floor").view(-1) * step.ppb * b * h
            ]
            assert (
                int(step.ws_valid.view(b, h, k, P).any(-1).sum(-1).max())
                <= k
                == cfg.blocks_to_select(layer.num_sealed * step.ppb)
            )
            held = step.codes[0].float() * step.scales[0]
            torch.testing.assert_close(held.view(b * h * k, P, d), exact.float(), atol=2e-2, rtol=2e-2)
        assert spy.steps > 10


def test_config_refuses_what_the_static_step_does_not_do():
    with pytest.raises(ConfigError, match="decode_step: static re-ranks .lsa_rerank: 4. by key codes held on the"):
        flashmem.FlashMemoryConfig(**{**PAGED, "lsa_rerank": 4}, decode_step="static")
    with pytest.raises(ConfigError, match="lsa_rerank_on_device False; allowed"):
        flashmem.FlashMemoryConfig(**{**PAGED, "lsa_rerank": 4, "lsa_rerank_codec": "int4"}, decode_step="static")
    flashmem.FlashMemoryConfig(**{**PAGED, **RERANK}, decode_step="static")  # codes on the device: allowed
    with pytest.raises(ConfigError, match="lsa_fetch_share: set, but decode_step is 'eager'"):
        flashmem.FlashMemoryConfig(**PAGED, lsa_fetch_share=0.5)
    with pytest.raises(ConfigError, match="use_summaries"):
        flashmem.FlashMemoryConfig(**{**PAGED, "use_summaries": True}, decode_step="static")


@pytest.mark.parametrize("extra", [{}, RERANK])
def test_a_beam_reorder_starts_a_new_segment_and_stays_exact(extra):
    """A row change replaces the layer's tiers (and drops the held candidates' codes): the
    segment sees it and starts again."""
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(7))
    outs = {}
    for step in ("eager", "static"):
        model = tiny_llama()
        cfg = flashmem.FlashMemoryConfig(**{**PAGED, **extra}, decode_step=step)
        with flashmem.attach(model, cfg) as cache, torch.no_grad():
            out = model(ids.expand(2, -1), cache=cache, use_cache=True)
            got = []
            for t in range(20):
                if t == 8:
                    cache.reorder_cache(torch.tensor([1, 0]))
                out = model(torch.tensor([[3], [9]]), cache=cache, use_cache=True)
                got.append(out.logits[:, -1])
            outs[step] = torch.stack(got)
    torch.testing.assert_close(outs["static"], outs["eager"], atol=2e-5, rtol=1e-4)


def test_traffic_counts_the_fixed_gather_and_the_attended_pages():
    """A static step's link bytes are its gather's, as read (int8: codes and fp32 scales per
    token, every layer), whatever is new; its pages held + read are the pages it attends, at
    most its selection."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(8))
    cfg = flashmem.FlashMemoryConfig(**PAGED, decode_step="static", lsa_fetch_share=0.4, working_set_codec="int8")
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        for _ in range(4):
            model(torch.full((1, 1), 5), cache=cache, use_cache=True)
        layers = cache.flash_layers
        steps = [layer.static for layer in layers]
        assert all(s is not None and s.filled and s.fetch < s.k for s in steps)
        model(torch.full((1, 1), 6), cache=cache, use_cache=True)
        cache.traffic_report()  # closes the step: its counts read
        last = cache._traffic.steps[-1]
    b, h, _, d = layers[0].sink_k.shape
    P = cfg.page_tokens
    assert last.counts["h2d_bytes"] == sum(b * h * s.fetch * 2 * P * (d + 4) for s in steps)
    # attended: the ranked pages in their slot (a new page past the cap waits)
    on = sum(int(s.ws_valid.view(b, h, s.k, P).any(-1).sum()) for s in steps)
    assert last.page_hits + last.page_misses == on <= sum(b * h * s.k for s in steps)
    assert 0 < last.page_misses <= sum(b * h * s.fetch for s in steps)


@pytest.mark.parametrize("extra", [{}, RERANK, {"lsa_fetch_share": 0.4}])
def test_graph_steps_replay_each_segment_and_give_the_eager_steps_logits(extra, monkeypatch):
    """decode_step graph: per layer and segment one eager step (the first reads every page), one
    warm-up, one capture, then replays, emulated here (a real capture needs CUDA). The logits are
    the static step's, so the eager step's where that one's are; without an emulation a CPU runs
    it as the static step and captures nothing."""
    from flashmem.cache import step_graph

    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(21))
    cfg = dict(extra, lsa_open_room=False)
    static = _logits("static", ids, 60, **cfg)
    model = tiny_llama()
    with flashmem.attach(model, flashmem.FlashMemoryConfig(**{**PAGED, **cfg}, decode_step="graph")) as cache:
        plain = run(model, cache, ids, 60)
        rep = cache.memory_report()
    assert rep["static_graph_captures"] == rep["static_graph_replays"] == 0 and rep["static_decode_steps"] > 100
    torch.testing.assert_close(plain, static, atol=0, rtol=0)
    monkeypatch.setattr(step_graph, "GRAPH", step_graph.EmulatedGraph)
    model = tiny_llama()
    with flashmem.attach(model, flashmem.FlashMemoryConfig(**{**PAGED, **cfg}, decode_step="graph")) as cache:
        with Spy() as spy:
            graphed = run(model, cache, ids, 60)
        rep = cache.memory_report()
    # every segment of 3+ steps captured once per layer; its later steps replayed
    long_enough = rep["static_graph_captures"]
    assert 4 <= long_enough <= spy.segments and rep["static_graph_failures"] == 0
    assert rep["static_graph_replays"] >= spy.steps - 3 * spy.segments > 50
    torch.testing.assert_close(graphed, static, atol=2e-5, rtol=1e-4)


def test_a_failed_capture_leaves_the_segment_static(monkeypatch):
    """A capture that raises (on CUDA: a gather whose ids must cross to the host) is counted and
    the segment's steps run eagerly, with the same logits."""
    from flashmem.cache import step_graph

    class Refused(step_graph.EmulatedGraph):
        def capture(self, fn, state):
            raise RuntimeError("operation not permitted when stream is capturing")

    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(22))
    static = _logits("static", ids, 30)
    monkeypatch.setattr(step_graph, "GRAPH", Refused)
    model = tiny_llama()
    with flashmem.attach(model, flashmem.FlashMemoryConfig(**PAGED, decode_step="graph")) as cache:
        graphed = run(model, cache, ids, 30)
        rep = cache.memory_report()
    assert rep["static_graph_failures"] >= 2 and rep["static_graph_replays"] == 0
    torch.testing.assert_close(graphed, static, atol=0, rtol=0)
