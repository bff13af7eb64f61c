"""Model specs for the memory calculator: what each layer keeps in its KV cache.

A model is a tuple of per-layer specs; each layer kind has its own byte term:

* `FullAttention`   (MHA / GQA / MQA): K and V of `kv_heads` heads per token.
* `SlidingWindow`   : the same, capped at the window (HF keeps `window - 1`
                      tokens after a step, see `DynamicSlidingWindowLayer`).
* `MLA`             (DeepSeek-V2/V3): one shared latent per token,
                      `kv_lora_rank + qk_rope_head_dim` elements (it is both K and V).
* `MLAIndexer`      (DeepSeek-V3.2 DSA): MLA + `index_head_dim` indexer keys per token.
* `CompressedV4`    (DeepSeek-V4 CSA / HCA): a sliding window of shared K=V entries
                      plus one compressed entry every `compress_rate` tokens
                      (CSA adds the indexer's compressed keys at the same rate).

All byte counts are per sequence; the calculator multiplies by the batch.
Counts follow what transformers 5.24's `DynamicCache` actually stores, so
they can be checked against real tensors (tests/test_memory_real_tensors.py).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from flashmem.errors import ConfigError
from flashmem.models import geometry


# ----------------------------------------------------------------------------- layer kinds
@dataclass(frozen=True)
class FullAttention:
    """Plain MHA/GQA layer: K (`head_dim`) and V (`v_head_dim`) per KV head per token."""

    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    kind: str = field(default="full", init=False)

    @property
    def _v(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def entry_elems(self) -> int:
        """Elements of one cached token (K and V, all KV heads)."""
        return self.kv_heads * (self.head_dim + self._v)

    def index_heads(self) -> tuple[int, int]:
        """(heads, key width) the block index summarises: one index per KV head."""
        return self.kv_heads, self.head_dim

    def stored_tokens(self, tokens: int) -> int:
        return tokens

    def cache_bytes(self, tokens: int, eb: int) -> int:
        return self.stored_tokens(tokens) * self.entry_elems() * eb

    def bytes_per_token(self, eb: int) -> Fraction:
        """Bytes one more token adds once the context is long (growth rate)."""
        return Fraction(self.entry_elems() * eb)

    def fixed_bytes(self, eb: int) -> int:
        """Bounded part of the cache at long context (windows)."""
        return 0

    managed = True  # FlashMemory tiers apply to it

    def describe(self) -> str:
        v = "" if self.v_head_dim is None else f", v {self._v}"
        return f"full attention: {self.kv_heads} KV heads x {self.head_dim}{v}"


@dataclass(frozen=True)
class SlidingWindow:
    """Sliding-window layer: like `FullAttention`, but only the last tokens are kept.

    transformers' `DynamicSlidingWindowLayer` keeps `window - 1` tokens between
    steps (the token being processed makes `window`); that is what we count.
    `shared_kv`: K and V are one tensor (DeepSeek-V4 sliding layers).
    """

    kv_heads: int
    head_dim: int
    window: int
    v_head_dim: int | None = None
    shared_kv: bool = False
    kind: str = field(default="sliding", init=False)

    def entry_elems(self) -> int:
        v = self.head_dim if self.v_head_dim is None else self.v_head_dim
        return self.kv_heads * (self.head_dim if self.shared_kv else self.head_dim + v)

    def stored_tokens(self, tokens: int) -> int:
        return min(tokens, max(self.window - 1, 0))

    def cache_bytes(self, tokens: int, eb: int) -> int:
        return self.stored_tokens(tokens) * self.entry_elems() * eb

    def bytes_per_token(self, eb: int) -> Fraction:
        return Fraction(0)

    def fixed_bytes(self, eb: int) -> int:
        return max(self.window - 1, 0) * self.entry_elems() * eb

    managed = False  # stays a plain sliding window under FlashMemory

    def describe(self) -> str:
        kv = "shared K=V" if self.shared_kv else "K+V"
        return f"sliding window {self.window}: {self.kv_heads} KV heads x {self.head_dim} ({kv})"


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3): one latent per token, shared by
    all heads, `kv_lora_rank` (compressed K/V) + `qk_rope_head_dim` (rotary key)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    kind: str = field(default="mla", init=False)

    def entry_elems(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def index_heads(self) -> tuple[int, int]:
        # the latent is the key (and the value); the index summarises it whole
        return 1, self.kv_lora_rank + self.qk_rope_head_dim

    def stored_tokens(self, tokens: int) -> int:
        return tokens

    def cache_bytes(self, tokens: int, eb: int) -> int:
        return tokens * self.entry_elems() * eb

    def bytes_per_token(self, eb: int) -> Fraction:
        return Fraction(self.entry_elems() * eb)

    def fixed_bytes(self, eb: int) -> int:
        return 0

    managed = True

    def describe(self) -> str:
        return f"MLA latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}"


@dataclass(frozen=True)
class MLAIndexer(MLA):
    """MLA + DSA lightning-indexer keys (DeepSeek-V3.2): `index_head_dim` more per token.

    Under FlashMemory the indexer keys are tiered together with the latent
    (one entry = latent + indexer key)."""

    index_head_dim: int = 128
    kind: str = field(default="mla_indexer", init=False)

    def entry_elems(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    def describe(self) -> str:
        return f"{super().describe()} + indexer {self.index_head_dim}"


@dataclass(frozen=True)
class CompressedV4:
    """DeepSeek-V4 CSA / HCA layer.

    Source: transformers/models/deepseek_v4/modeling_deepseek_v4.py
    (`DeepseekV4HCACache`, `DeepseekV4CSACache`, `DeepseekV4Attention`) and
    configuration_deepseek_v4.py (fields `layer_types`, `compress_rates`,
    `sliding_window`, `head_dim`, `index_head_dim`). Per layer the cache holds:

    * a sliding window of `sliding_window - 1` entries of `head_dim`, K and V
      being the same tensor (single-KV-head MQA, `values = keys`);
    * `floor(T / compress_rate)` compressed entries of `head_dim` (K = V);
    * CSA only: `floor(T / compress_rate)` compressed indexer keys of `index_head_dim`.

    Not counted: the compressors' bounded scratch state (buffer of fewer than
    `compress_rate` projected tokens and the CSA overlap slice), a few KiB
    per layer that does not grow with T.
    """

    head_dim: int
    window: int
    compress_rate: int
    index_head_dim: int = 0  # CSA: indexer keys; HCA: 0
    kind: str = field(default="v4_hca", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", "v4_csa" if self.index_head_dim else "v4_hca")

    def stored_tokens(self, tokens: int) -> int:
        return min(tokens, max(self.window - 1, 0))

    def cache_bytes(self, tokens: int, eb: int) -> int:
        window = self.stored_tokens(tokens) * self.head_dim
        entries = (tokens // self.compress_rate) * (self.head_dim + self.index_head_dim)
        return (window + entries) * eb

    def bytes_per_token(self, eb: int) -> Fraction:
        return Fraction((self.head_dim + self.index_head_dim) * eb, self.compress_rate)

    def fixed_bytes(self, eb: int) -> int:
        return max(self.window - 1, 0) * self.head_dim * eb

    managed = False  # already compressed natively; FlashMemory leaves it as is

    def describe(self) -> str:
        name = "CSA" if self.index_head_dim else "HCA"
        idx = f" + indexer {self.index_head_dim}" if self.index_head_dim else ""
        return f"V4 {name} 1/{self.compress_rate}: {self.head_dim}{idx} per entry, " f"window {self.window}"


LayerSpec = FullAttention | SlidingWindow | MLA | MLAIndexer | CompressedV4


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: tuple[LayerSpec, ...]
    dtype: str = "bfloat16"
    source: str = "built-in"
    # `layers` repeated this many times: a model given by dimensions is one layer kind
    # times a count that may be huge, sized by arithmetic, never one object per layer
    repeat: int = 1

    @property
    def num_layers(self) -> int:
        return len(self.layers) * self.repeat

    def layer_positions(self) -> list[tuple[LayerSpec, range]]:
        """Each distinct layer entry with the layer indices it stands for."""
        step = len(self.layers)
        return [(layer, range(j, self.num_layers, step)) for j, layer in enumerate(self.layers)]

    def summary(self) -> str:
        groups: dict[str, int] = {}
        for layer in self.layers:
            d = layer.describe()
            groups[d] = groups.get(d, 0) + self.repeat
        return "; ".join(f"{n} x {d}" for d, n in groups.items())


# ----------------------------------------------------------------------------- built-ins
def _gemma3_270m() -> ModelSpec:
    # google/gemma-3-270m config: 18 layers, num_key_value_heads 1, head_dim 256,
    # sliding_window 512; layer_types from transformers' Gemma3TextConfig default
    # (`sliding_window_pattern` 6: layer i is full when (i + 1) % 6 == 0, i.e. 5
    # sliding : 1 full -> layers 5, 11, 17 are full).
    layers = tuple(
        FullAttention(1, 256) if t == geometry.FULL else SlidingWindow(1, 256, 512)
        for t in geometry.gemma3_layer_types(18)
    )
    return ModelSpec("gemma3-270m", layers)


def _v4_layers(
    layer_types: list[str], head_dim: int, window: int, index_head_dim: int, rates: dict[str, int]
) -> tuple[LayerSpec, ...]:
    out: list[LayerSpec] = []
    for t in layer_types:
        if t == "sliding_attention":
            out.append(SlidingWindow(1, head_dim, window, shared_kv=True))
        elif t == "compressed_sparse_attention":
            out.append(CompressedV4(head_dim, window, rates[t], index_head_dim))
        elif t == "heavily_compressed_attention":
            out.append(CompressedV4(head_dim, window, rates[t], 0))
        else:
            raise ConfigError(f"layer_types: {t!r} is not a DeepSeek-V4 layer type")
    return tuple(out)


_V4_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _deepseek_v4_flash() -> ModelSpec:
    # transformers/models/deepseek_v4/configuration_deepseek_v4.py defaults are the
    # V4-Flash checkpoint (`@auto_docstring(checkpoint="deepseek-ai/DeepSeek-V4-Flash-Base")`):
    # num_hidden_layers 43, num_key_value_heads 1, head_dim 512, sliding_window 128,
    # index_head_dim 128, compress_rates {CSA: 4, HCA: 128}. Its *default* layer_types
    # is the V4-Pro pattern, so the Flash layout comes from the published
    # DeepSeek-V4-Flash config (`compress_ratios`): layers 0-1 sliding only (ratio 0),
    # then ratio 4 (CSA) on even and 128 (HCA) on odd layers. Assumption stated: taken
    # from the public model card / config, not from code installed here.
    types = ["sliding_attention"] * 2 + [
        "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention" for i in range(2, 43)
    ]
    return ModelSpec("deepseek-v4-flash", _v4_layers(types, 512, 128, 128, _V4_RATES))


def _deepseek_v4_pro() -> ModelSpec:
    # DeepSeek-V4-Pro: 61 layers (public config: hidden 7168, 128 heads, head_dim 512,
    # 1 KV head, sliding_window 128, index_head_dim 128). Layout = the installed
    # DeepseekV4Config's default `layer_types` ("V4-Pro default: 2x HCA bootstrap +
    # interleaved CSA / HCA"): layers 0-1 HCA, then HCA, CSA, HCA, ... (CSA on odd i
    # of the interleave) -> 32 HCA + 29 CSA layers.
    n = 61
    types = ["heavily_compressed_attention"] * 2 + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(n - 2)
    ]
    return ModelSpec("deepseek-v4-pro", _v4_layers(types, 512, 128, 128, _V4_RATES))


BUILTIN_MODELS = {
    # HuggingFaceTB/SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    "smollm2": lambda: ModelSpec("smollm2", (FullAttention(3, 64),) * 30),
    "gemma3-270m": _gemma3_270m,
    # meta-llama/Llama-3.1-8B / 70B: GQA with 8 KV heads of 128
    "llama-3.1-8b": lambda: ModelSpec("llama-3.1-8b", (FullAttention(8, 128),) * 32),
    "llama-3.1-70b": lambda: ModelSpec("llama-3.1-70b", (FullAttention(8, 128),) * 80),
    # Qwen/Qwen2.5-7B: 28 layers, 4 KV heads of 128 (use_sliding_window false)
    "qwen2.5-7b": lambda: ModelSpec("qwen2.5-7b", (FullAttention(4, 128),) * 28),
    # deepseek-ai/DeepSeek-V3: 61 MLA layers, kv_lora_rank 512, qk_rope_head_dim 64
    "deepseek-v3": lambda: ModelSpec("deepseek-v3", (MLA(512, 64),) * 61),
    # deepseek-ai/DeepSeek-V3.2: V3 + DSA indexer keys (index_head_dim 128) in every layer
    "deepseek-v3.2": lambda: ModelSpec("deepseek-v3.2", (MLAIndexer(512, 64, 128),) * 61),
    "deepseek-v4-flash": _deepseek_v4_flash,
    "deepseek-v4-pro": _deepseek_v4_pro,
}
_ALIASES = {
    "smollm2-135m": "smollm2",
    "smollm2-135m-instruct": "smollm2",
    "gemma-3-270m": "gemma3-270m",
    "llama3.1-8b": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "deepseek-v32": "deepseek-v3.2",
}


def builtin_names() -> list[str]:
    return list(BUILTIN_MODELS)


# ----------------------------------------------------------------------------- resolution
def resolve_model(model: Any) -> ModelSpec:
    """A built-in name, an HF folder / config.json, a .gguf file, a transformers
    config object, a config dict or a ModelSpec -> ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return from_hf_config(model, name=str(model.get("model_type", "config")))
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return from_hf_config(model, name=str(getattr(model, "name_or_path", "") or model.model_type))
    if isinstance(model, Path):
        model = str(model)
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"--model: {model!r} is not allowed; allowed: {_model_help()}")
    key = model.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]()
    path = Path(model).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if cfg.is_file():
            return from_hf_folder(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return from_gguf(ggufs[0])
        raise ConfigError(f"--model: {model}: folder has no config.json; allowed: {_model_help()}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return from_gguf(path)
        if path.suffix.lower() == ".json":
            return from_hf_folder(path.parent, config_file=path)
        raise ConfigError(f"--model: {model}: not a .gguf or config.json file; allowed: {_model_help()}")
    near = difflib.get_close_matches(key, list(BUILTIN_MODELS) + list(_ALIASES), n=1, cutoff=0.4)
    hint = f"did you mean {_ALIASES.get(near[0], near[0])!r}? " if near else ""
    raise ConfigError(f"--model: unknown model {model!r}; {hint}allowed: {_model_help()}")


def _model_help() -> str:
    return ", ".join(BUILTIN_MODELS) + ", a folder with config.json, or a .gguf file"


# Sizes stay exact integers; beyond this a byte count no longer fits a float for GB/GiB.
MAX_DIM = 10**24


def from_dims(layers: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16") -> ModelSpec:
    for flag, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_DIM:
            raise ConfigError(f"{flag}: {v!r} is not allowed; allowed: an integer from 1 to 10**24")
    return ModelSpec(
        f"{layers} layers x {kv_heads} KV heads x {head_dim}",
        (FullAttention(kv_heads, head_dim),),
        dtype=dtype,
        source="dimensions",
        repeat=layers,
    )


def from_hf_folder(folder: Path, config_file: Path | None = None) -> ModelSpec:
    config_file = config_file or folder / "config.json"
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model: {config_file}: cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model: {config_file}: not a JSON object")
    cfg: Any = data
    try:  # transformers fills in defaults (e.g. Gemma3 layer_types); offline, local only
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(config_file.parent), local_files_only=True)
    except Exception:  # unknown model_type or odd file: fall back to the raw dict
        cfg = data
    spec = from_hf_config(cfg, name=str(folder))
    return ModelSpec(spec.name, spec.layers, spec.dtype, source=str(config_file), repeat=spec.repeat)


_get = geometry.get


def from_hf_config(cfg: Any, name: str = "config") -> ModelSpec:
    """transformers `PretrainedConfig` (or its dict) -> ModelSpec, following what the
    model's `DynamicCache` stores in transformers 5.24."""
    if not isinstance(cfg, dict) and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    elif isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    dtype = _config_dtype(cfg)
    n = _get(cfg, "num_hidden_layers") or _get(cfg, "n_layer") or _get(cfg, "num_layers")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"--model: {name}: no num_hidden_layers in the config")
    model_type = str(_get(cfg, "model_type", ""))
    if model_type == "deepseek_v4":
        return ModelSpec(name, _deepseek_v4_layers(cfg, n), dtype, source="config")
    kv_lora = _get(cfg, "kv_lora_rank")
    if kv_lora:
        rope = int(_get(cfg, "qk_rope_head_dim", 64))
        idx = _get(cfg, "index_head_dim")
        if idx and model_type in ("deepseek_v32", "glm_moe_dsa"):
            layer: LayerSpec = MLAIndexer(int(kv_lora), rope, int(idx))
        else:
            layer = MLA(int(kv_lora), rope)
        return ModelSpec(name, (layer,) * n, dtype, source="config")
    return ModelSpec(name, _attention_layers(cfg, n, name), dtype, source="config")


def _config_dtype(cfg: Any) -> str:
    """The config's dtype name without "torch." (`torch_dtype` in older files; bfloat16 when none)."""
    dtype = _get(cfg, "dtype", None)
    if dtype is None and isinstance(cfg, dict):  # older config.json files
        dtype = cfg.get("torch_dtype")
    dtype = str(dtype or "bfloat16")
    return dtype.replace("torch.", "")


def _deepseek_v4_layers(cfg: Any, n: int) -> tuple[LayerSpec, ...]:
    """DeepSeek-V4's layers from its config; see CompressedV4 for the source lines, defaults as in DeepseekV4Config."""
    types = _get(cfg, "layer_types")
    if types is None and _get(cfg, "compress_ratios") is not None:
        m = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        types = [m[r] for r in _get(cfg, "compress_ratios")]
    if types is None:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
        ]
    rates = dict(_V4_RATES)
    rates.update(_get(cfg, "compress_rates", {}) or {})
    return _v4_layers(
        list(types)[:n],
        int(_get(cfg, "head_dim", 512)),
        int(_get(cfg, "sliding_window", 128)),
        int(_get(cfg, "index_head_dim", 128)),
        rates,
    )


def _attention_layers(cfg: Any, n: int, name: str) -> tuple[LayerSpec, ...]:
    """Full, sliding-window and chunked attention layers (K and V per KV head) from the config's layer types."""
    kv_heads, head_dim = geometry.kv_heads(cfg), geometry.head_dim(cfg)
    if not kv_heads or not head_dim:
        raise ConfigError(f"--model: {name}: config lacks num_key_value_heads/head_dim")
    window = _get(cfg, "sliding_window")
    types = geometry.layer_types(cfg, n)
    out: list[LayerSpec] = []
    for t in list(types)[:n]:
        if t == "sliding_attention" and window:
            out.append(SlidingWindow(kv_heads, head_dim, int(window)))
        elif t == "chunked_attention" and _get(cfg, "attention_chunk_size"):
            out.append(SlidingWindow(kv_heads, head_dim, int(_get(cfg, "attention_chunk_size"))))
        elif t in ("full_attention", "sliding_attention", "chunked_attention"):
            out.append(FullAttention(kv_heads, head_dim))
        else:
            raise ConfigError(
                f"--model: {name}: layer type {t!r} is not supported by the calculator; "
                "allowed: full_attention, sliding_attention, chunked_attention"
            )
    return tuple(out)


def from_gguf(path: Path) -> ModelSpec:
    """Read layer geometry from GGUF metadata (no tensor data is loaded).

    K/V dtype defaults to float16 (llama.cpp's default cache type); override
    with --dtype. Gemma3: the GGUF has no layer pattern; llama.cpp and
    transformers both use 5 sliding : 1 full.
    """
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path), "r")
    except Exception as exc:
        raise ConfigError(f"--model: {path}: not a readable GGUF file ({type(exc).__name__})") from None

    def val(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception:
            return default

    arch = val("general.architecture")
    if not arch:
        raise ConfigError(f"--model: {path}: GGUF lacks general.architecture")
    n = val(f"{arch}.block_count")
    heads = val(f"{arch}.attention.head_count")
    kv = val(f"{arch}.attention.head_count_kv", heads)
    emb = val(f"{arch}.embedding_length")
    if not n or not heads:
        raise ConfigError(f"--model: {path}: GGUF lacks {arch}.block_count/attention.head_count")
    heads_l = heads if isinstance(heads, list) else [heads] * n
    kv_l = kv if isinstance(kv, list) else [kv] * n
    key_len = val(f"{arch}.attention.key_length")
    val_len = val(f"{arch}.attention.value_length")
    window = val(f"{arch}.attention.sliding_window")
    layers: list[LayerSpec] = []
    for i in range(n):
        hd = int(key_len or emb // heads_l[i])
        vd = int(val_len) if val_len and val_len != hd else None
        if arch == "gemma3" and window and geometry.gemma3_layer_types(n)[i] == geometry.SLIDING:
            layers.append(SlidingWindow(int(kv_l[i]), hd, int(window), v_head_dim=vd))
        else:
            layers.append(FullAttention(int(kv_l[i]), hd, v_head_dim=vd))
    name = str(val("general.name") or path.name)
    return ModelSpec(name, tuple(layers), "float16", source=str(path))
