"""A decode step whose decoded keys and values would pass DECODE_KV_BYTES attends them in runs
merged by their log-sum-exp (`Assembly._attend_in_runs`): the same logits as one attention over
all of them, and buffers that stay the run's size as the context grows."""

from __future__ import annotations

import sys

import pytest
import torch

import flashmem
from flashmem.cache import assembly, sdpa
from flashmem.cache.scratch import thread_scratch
from test_cache import ALL_EXACT, SMALL, reference, run
from tiny_models import MODELS, tiny_llama


def run_bytes(model, rows: int, tokens: int) -> int:
    """DECODE_KV_BYTES for runs of `tokens`: K and V of `rows` sequences, fp32."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * rows * c.num_key_value_heads * d * 4 * tokens


def test_runs_cut_parts_in_order_and_split_the_ones_that_span_two():
    assert assembly.runs([3, 4, 1], 5) == [[(0, 0, 3), (1, 0, 2)], [(1, 2, 4), (2, 0, 1)]]
    assert assembly.runs([12], 5) == [[(0, 0, 5)], [(0, 5, 10)], [(0, 10, 12)]]
    assert assembly.runs([5, 1], 5) == [[(0, 0, 5)], [(1, 0, 1)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_lse_equals_attention_and_gives_its_log_sum_exp(dtype):
    """The fused kernel (fp32 on a CPU) and the scores' way alike; a head that sees no key
    weighs nothing (lse -inf, out 0)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 8, generator=g).to(dtype)
    k, v = torch.randn(2, 3, 9, 8, generator=g).to(dtype), torch.randn(2, 3, 9, 8, generator=g).to(dtype)
    bias = torch.randn(2, 3, 9, generator=g).to(dtype)
    bias[0, 1, 4:] = float("-inf")
    bias[1, 2] = float("-inf")  # sees nothing
    out, lse = sdpa.attention_lse(q, k, v, bias, 0.3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * 0.3 + bias.float()[:, :, None, :]
    want = torch.softmax(s, -1).nan_to_num(0.0) @ v.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out - want).abs().max() <= tol
    seen = torch.ones(2, 3, dtype=torch.bool)
    seen[1, 2] = False
    assert torch.allclose(lse[seen], torch.logsumexp(s, -1)[seen], atol=tol)
    assert (lse[1, 2] == float("-inf")).all() and (out[1, 2] == 0).all()


CASES = {
    "every page": dict(ALL_EXACT),
    "int8 working set, rest entry": dict(
        SMALL, lsa_top_k=2, use_summaries=False, rest_entry=True, working_set_codec="int8", lsa_page_tokens=4
    ),
    "summaries": dict(SMALL, lsa_top_k=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_a_step_in_runs_gives_the_one_attentions_logits(monkeypatch, arch, case):
    """Padded rows, sinks, the working set split across runs (int8 codes decoded run by run, the
    rest entry's working-set values summed run by run), summaries and the window."""
    model = MODELS[arch]()
    a, b = torch.randint(0, 128, (1, 150)), torch.randint(0, 128, (1, 97))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 53, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :53] = 0
    cfg = flashmem.FlashMemoryConfig(**CASES[case])
    whole = run(model, flashmem.attach(model, cfg), ids, 12, mask)
    calls = []
    real = assembly.Assembly._attend_in_runs
    monkeypatch.setattr(assembly.Assembly, "_attend_in_runs", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(assembly, "DECODE_KV_BYTES", run_bytes(model, 2, 5))
    in_runs = run(model, flashmem.attach(model, cfg), ids, 12, mask)
    assert calls and set(calls) == {5}  # every step, in runs of 5 tokens
    assert (in_runs - whole).abs().max() <= 1e-4
    if case == "every page":
        assert (in_runs - reference(model, ids, 12, mask)).abs().max() <= 1e-4


def test_a_steps_buffers_stay_the_runs_size_as_the_context_grows(monkeypatch):
    """With every page attended, a step's keys and values grow with the context; in runs the
    reused buffers hold one run (a quarter to spare), whatever the length."""
    model = tiny_llama()
    monkeypatch.setattr(assembly, "DECODE_KV_BYTES", run_bytes(model, 1, 5))

    def scratch_after(tokens: int) -> int:
        ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
        cache = flashmem.attach(model, flashmem.FlashMemoryConfig(**ALL_EXACT))
        with torch.no_grad():
            flashmem.prefill(model, cache, ids)  # prompt_done: the prompt's buffers dropped
            model(ids[:, -1:], cache=cache, use_cache=True)
            model(ids[:, -1:], cache=cache, use_cache=True)
        return thread_scratch().nbytes()

    assert scratch_after(200) == scratch_after(800) <= 1.25 * run_bytes(model, 1, 5)
    monkeypatch.setattr(assembly, "DECODE_KV_BYTES", 1 << 40)  # one attention: the buffers grow
    assert scratch_after(800) > 3 * scratch_after(200) > 0


def test_a_cpu_with_a_disk_tier_attends_in_smaller_runs(monkeypatch, tmp_path):
    """On a CPU whose cold tier is off RAM (a disk tier) a step's buffers are held to
    DECODE_KV_BYTES_OFF_RAM, the memory tier's to DECODE_KV_BYTES; the logits are the same."""
    model = tiny_llama()
    monkeypatch.setattr(assembly, "DECODE_KV_BYTES", run_bytes(model, 1, 400))
    monkeypatch.setattr(assembly, "DECODE_KV_BYTES_OFF_RAM", run_bytes(model, 1, 40))
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(0))

    def step(**where) -> tuple[torch.Tensor, int]:
        thread_scratch().clear()
        with flashmem.attach(model, flashmem.FlashMemoryConfig(**ALL_EXACT, **where)) as cache, torch.no_grad():
            flashmem.prefill(model, cache, ids)
            thread_scratch().clear()  # the decode steps' buffers alone
            for _ in range(2):
                logits = model(ids[:, -1:], cache=cache, use_cache=True).logits
        return logits, thread_scratch().nbytes()

    in_ram, ram_bytes = step()
    on_disk, disk_bytes = step(cold_store="disk", cold_dir=str(tmp_path / "cold"))
    assert 0 < disk_bytes <= 1.25 * run_bytes(model, 1, 40) + (64 << 10) < ram_bytes  # (the mask's buffer beside)
    assert (on_disk - in_ram).abs().max() <= 1e-4
    thread_scratch().clear()


def test_a_working_set_past_the_runs_bound_is_coded_without_a_whole_decoded_copy(monkeypatch):
    """An int8 working set made whole (`WorkingSet.set`: the first decode step's selection) keeps
    the decoded copy coding makes in passing only where a decode step attends it in one run;
    past that the runs decode its codes, so the step holds no layer-sized copy in the model's
    dtype (stop 66: a disk tier's first decode step). The logits are the same either way."""
    from flashmem.cache import working_set

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    cfg = flashmem.FlashMemoryConfig(**CASES["int8 working set, rest entry"])
    real = working_set.page_code.encode_and_decode
    made: list[tuple[int, bool]] = []  # a whole set's (bytes coded, decoded copy asked for)

    def spy(x, dtype):
        if sys._getframe(1).f_code.co_name == "_store":  # not a merge's new pages (coded alone)
            made.append((x.numel() * x.element_size(), dtype is not None))
        return real(x, dtype)

    monkeypatch.setattr(working_set.page_code, "encode_and_decode", spy)
    whole = run(model, flashmem.attach(model, cfg), ids, 6)
    assert made and all(copy for _, copy in made)  # within the bound: the copy, as before
    made.clear()
    bound = run_bytes(model, 1, 5)
    monkeypatch.setattr(assembly, "DECODE_KV_BYTES", bound)
    in_runs = run(model, flashmem.attach(model, cfg), ids, 6)
    past = [copy for n, copy in made if 2 * n > bound]
    assert past and not any(past)
    assert (in_runs - whole).abs().max() <= 1e-4
