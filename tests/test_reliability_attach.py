"""Issue 30: attach refuses what it cannot serve; the step guard catches half-updated
caches whatever raised, and a second thread inside a running step."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import flashmem
from flashmem.errors import FlashMemError
from test_cache import SMALL
from tiny_models import tiny_gemma3, tiny_llama, tiny_qwen2

torch.set_num_threads(1)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)


def _cfg(**kw) -> flashmem.FlashMemoryConfig:
    return flashmem.FlashMemoryConfig(**{**SMALL, "lsa_top_k": 2, "prefetch_threads": 0, **kw})


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


def _mistral(window: int | None) -> MistralForCausalLM:
    torch.manual_seed(0)
    cfg = MistralConfig(**TINY, num_key_value_heads=2, sliding_window=window, max_position_embeddings=4096)
    return MistralForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "make,names",
    [
        (lambda: None, ["None"]),
        (lambda: "smollm2", ["'smollm2'", "load_model"]),
        (lambda: nn.Linear(4, 4), ["torch.nn.modules.linear.Linear", "not a transformers model"]),
        (
            lambda: T5ForConditionalGeneration(
                T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=128)
            ),
            ["'t5'", "encoder-decoder"],
        ),
        (lambda: BertForMaskedLM(BertConfig(**TINY)), ["'bert'", "causal LM"]),
        (
            lambda: MambaForCausalLM(MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=4)),
            ["'mamba'", "no attention layers"],
        ),
        (lambda: _mistral(16), ["'mistral'", "sliding_window=16"]),
    ],
    ids=["none", "string", "linear", "t5", "bert", "mamba", "mistral-window"],
)
def test_attach_refuses_what_it_cannot_serve_in_one_line(make, names) -> None:
    model = make()
    with pytest.raises(FlashMemError) as err:
        flashmem.attach(model, _cfg())
    msg = _one_line(err.value)
    for n in names:
        assert n in msg, msg
    assert "allowed: a decoder-only causal LM" in msg
    if isinstance(model, nn.Module) and hasattr(model, "config"):  # nothing was switched before the refusal
        assert model.config._attn_implementation != "tiered_kv"


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, tiny_gemma3, lambda: _mistral(None), lambda: _mistral(4096)])
def test_attach_accepts_supported_models(make) -> None:
    """Full attention, sliding layers declared in layer_types (Gemma3), and Mistral whose
    window is off or covers the whole context."""
    model = make()
    with flashmem.attach(model, _cfg()) as cache:
        with torch.no_grad():
            out = model(torch.arange(3, 40).unsqueeze(0), cache=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()


# ------------------------------------------------------------------ the step guard
def _fail_once(module: nn.Module) -> None:
    """Make `module` raise on its next call only."""
    real = module.forward

    def boom(*a, **k):
        module.forward = real
        raise RuntimeError("q_proj exploded")

    module.forward = boom


def test_half_updated_layers_are_refused_until_reset_whatever_raised() -> None:
    """An exception in layer 1's q_proj (before its cache update) leaves the layers [161, 160]:
    the next step is one line, not silently different logits; reset() starts over exactly."""
    model = tiny_llama()
    prompt = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(0))
    with flashmem.attach(model, _cfg()) as fresh, torch.no_grad():
        model(prompt, cache=fresh, use_cache=True)
        want = model(torch.tensor([[7]]), cache=fresh, use_cache=True).logits
    with flashmem.attach(model, _cfg()) as cache, torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        _fail_once(model.model.layers[1].self_attn.q_proj)
        with pytest.raises(RuntimeError, match="q_proj exploded"):
            model(torch.tensor([[5]]), cache=cache, use_cache=True)
        assert [layer.get_seq_length() for layer in cache.layers] == [161, 160]
        with pytest.raises(FlashMemError) as err:
            model(torch.tensor([[7]]), cache=cache, use_cache=True)
        msg = _one_line(err.value)
        assert "[161, 160]" in msg and "reset()" in msg
        with pytest.raises(FlashMemError):  # still refused
            model(torch.tensor([[7]]), cache=cache, use_cache=True)
        cache.reset()
        model(prompt, cache=cache, use_cache=True)
        got = model(torch.tensor([[7]]), cache=cache, use_cache=True).logits
    assert torch.equal(got, want)


def test_second_thread_inside_a_running_step_is_refused_in_one_line() -> None:
    model = tiny_llama()
    prompt = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    with flashmem.attach(model, _cfg()) as fresh, torch.no_grad():
        want = model(prompt, cache=fresh, use_cache=True).logits
    inside, release = threading.Event(), threading.Event()
    q1 = model.model.layers[1].self_attn.q_proj
    real = q1.forward

    def slow(x):  # thread A stops inside its step, between layer 0 and layer 1
        if threading.current_thread().name == "A":
            inside.set()
            assert release.wait(30)
        return real(x)

    q1.forward = slow
    result: dict[str, object] = {}
    try:
        with flashmem.attach(model, _cfg()) as cache:

            def a() -> None:
                with torch.no_grad():
                    result["a"] = model(prompt, cache=cache, use_cache=True).logits

            ta = threading.Thread(target=a, name="A")
            ta.start()
            assert inside.wait(30)
            with pytest.raises(FlashMemError) as err, torch.no_grad():
                model(prompt, cache=cache, use_cache=True)  # this thread, while A is mid-step
            release.set()
            ta.join(30)
            msg = _one_line(err.value)
            assert "in use by thread 'A'" in msg and "one thread at a time" in msg
            # A's step was not disturbed, and the cache may move to this thread between steps
            assert torch.equal(result["a"], want)
            with torch.no_grad():
                model(torch.tensor([[3]]), cache=cache, use_cache=True)
            assert [layer.get_seq_length() for layer in cache.layers] == [101, 101]
    finally:
        q1.forward = real
        release.set()
