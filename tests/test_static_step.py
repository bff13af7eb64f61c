"""`decode_step: static` (cache/static_step.py): the decode steps between two seals with fixed
shapes and no host reads give the eager step's logits, wait on nothing, trace whole under
torch.compile(fullgraph=True), and with `lsa_fetch_share` hold what they say they hold."""

from __future__ import annotations

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


class Waits(TorchDispatchMode):
    """Operators whose result the host reads: it waits for the device's queue there."""

    NAMES = ("_local_scalar_dense", "nonzero", "unique", "_unique", "is_nonzero", "equal", "masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else ()) or ()
        )
        self.waits += name.startswith(self.NAMES) or bool_index
        self.kernels += not func.is_view
        return func(*args, **(kwargs or {}))


def _step_counts(step: str) -> tuple[int, int]:
    """Waits and kernels of one decode step in the middle of a segment (two layers)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    cfg = flashmem.FlashMemoryConfig(**PAGED, decode_step=step)
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


def test_device_step_traces_whole_and_gives_the_same_result():
    """torch.compile(fullgraph=True) refuses a graph break: a host read, a data-dependent shape,
    an unsupported out= write. The traced step equals the eager one, state updates included."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(5))
    cfg = flashmem.FlashMemoryConfig(**PAGED, decode_step="static", lsa_fetch_share=0.4)
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
    with pytest.raises(ConfigError, match="decode_step: static does not support lsa_rerank: 4"):
        flashmem.FlashMemoryConfig(**{**PAGED, "lsa_rerank": 4}, decode_step="static")
    with pytest.raises(ConfigError, match="lsa_fetch_share: set, but decode_step is 'eager'"):
        flashmem.FlashMemoryConfig(**PAGED, lsa_fetch_share=0.5)
    with pytest.raises(ConfigError, match="use_summaries"):
        flashmem.FlashMemoryConfig(**{**PAGED, "use_summaries": True}, decode_step="static")


def test_a_beam_reorder_starts_a_new_segment_and_stays_exact():
    """A row change replaces the layer's tiers: the segment sees it and starts again."""
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(7))
    outs = {}
    for step in ("eager", "static"):
        model = tiny_llama()
        cfg = flashmem.FlashMemoryConfig(**PAGED, decode_step=step)
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
