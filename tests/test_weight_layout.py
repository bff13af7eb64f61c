"""Linear weights stored [in, out] for the CPU's GEMM (flashmem.models.weight_layout)."""

from __future__ import annotations

import pytest
import torch

from flashmem.errors import FlashMemError
from flashmem.models import load_model, weight_layout
from flashmem.models.weight_layout import auto_layout, linear_layout, set_linear_layout
from tiny_models import tiny_gemma3, tiny_llama


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_in_major_keeps_values_shapes_and_ties(build):
    model = build()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    n_weights = len({id(m.weight) for m in _linears(model)})
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}

    assert set_linear_layout(model, "in_major") == n_weights
    # nothing keeps pointing at the loaded storage (a file mapping, when safetensors loaded it)
    assert all(p.untyped_storage().data_ptr() != storages[n] for n, p in model.named_parameters())
    assert linear_layout(model) == "in_major"
    for m in _linears(model):
        w = m.weight
        assert w.shape == (m.out_features, m.in_features) and w.stride() == (1, m.out_features)
        assert w.t().is_contiguous()
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still one tied Parameter
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # only the memory order moved
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)

    assert set_linear_layout(model, "in_major") == 0  # already laid out
    assert set_linear_layout(model, "out_major") == n_weights
    assert linear_layout(model) == "out_major"
    assert all(m.weight.is_contiguous() for m in _linears(model))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_auto_is_in_major_only_for_fp32_on_an_mkl_x86_cpu(monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(weight_layout.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    assert auto_layout(model) == "in_major"
    assert auto_layout(model.to(torch.bfloat16)) == "out_major"  # oneDNN's bf16 path prefers [out, in]
    model.float()
    monkeypatch.setattr(weight_layout.platform, "machine", lambda: "aarch64")
    assert auto_layout(model) == "out_major"
    monkeypatch.setattr(weight_layout.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert auto_layout(model) == "out_major"


def test_bad_layout_is_a_user_error():
    with pytest.raises(ValueError, match="out_major, in_major, onednn"):
        set_linear_layout(tiny_llama(), "column")
    with pytest.raises(FlashMemError, match="weight_layout must be auto, out_major, in_major, onednn; got 'rows'"):
        load_model("smollm2", weight_layout="rows")  # refused before anything is loaded


def test_load_model_lays_out_a_folder(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "m")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>"))
    ).save_pretrained(tmp_path / "m")
    for layout in ("in_major", "out_major"):
        m, _ = load_model(tmp_path / "m", weight_layout=layout)
        assert linear_layout(m) == layout
    m, _ = load_model(tmp_path / "m")
    assert linear_layout(m) == auto_layout(m)


def test_served_prefixes_are_keyed_by_the_layout():
    """A prefix stored by a server with the other layout holds K/V rounded another way: not reused."""
    from flashmem.serve.engine import _fingerprint
    from serve_helpers import tiny_cfg, tiny_model

    model, cfg = tiny_model(), tiny_cfg()
    prints = {}
    for layout in ("out_major", "in_major", "out_major"):
        set_linear_layout(model, layout)
        prints.setdefault(layout, set()).add(_fingerprint(model, cfg, "tiny", 32))
    assert len(prints["out_major"]) == 1 and prints["out_major"] != prints["in_major"]


def test_quantized_or_integer_linears_are_left_alone():
    class QuantLinear(torch.nn.Linear):  # a quantizing library's subclass computes from its own layout
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), QuantLinear(4, 6), torch.nn.Linear(4, 6))
    model[2].weight = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.int8), requires_grad=False)
    assert set_linear_layout(model, "in_major") == 1
    assert model[0].weight.stride() == (1, 6)
    assert model[1].weight.is_contiguous() and model[2].weight.is_contiguous()
    assert linear_layout(model) == "in_major"  # every weight it lays out is


def test_a_re_laid_model_saves_and_reloads_equal(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    set_linear_layout(model, "in_major")
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    want = model.state_dict()
    got = again.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
