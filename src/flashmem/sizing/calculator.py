"""KV-cache memory calculator: `flashmem.estimate(...)` and `flashmem estimate`.

Full cache: the sum of each layer's own term (see `flashmem.sizing.specs`),
times the batch. With a `FlashMemoryConfig`, the FlashMemory split: every
managed layer (full attention or MLA, not in `keep_full_layers`) is sized
with `flashmem.sizing.tiers.tier_counts`, the same arithmetic the cache uses;
full layers keep a plain cache; sliding-window and DeepSeek-V4 compressed
layers stay as the model has them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from flashmem import tier_names
from flashmem.config import FlashMemoryConfig
from flashmem.errors import ConfigError
from flashmem.sizing.specs import MLA, FullAttention, ModelSpec, from_dims, resolve_model
from flashmem.sizing.tiers import TierCounts, codec_bytes_per_element, index_bytes, tier_counts, working_set_scale
from flashmem.sizing.units import DTYPE_BYTES, normalize_dtype, parse_tokens

# The int8/int4 codecs' group (flashmem.store.codecs.kivi.GROUP): values are coded per
# token in groups of this many elements, a shorter row padded to it.
CODE_GROUP = 32


def cold_elements_per_token(mode: str, rank: int | None, head_dim: int, v_head_dim: int | None = None) -> int:
    """Cold-tier elements per token and KV head, K and V together, under `cold_low_rank`
    (`flashmem.cache.latent.LatentKV` stores exactly this): a low-rank part keeps
    `rank` coefficients instead of its head_dim, and the packed row of two unequal
    parts is rounded up to an even width (two equal store slots)."""
    v = head_dim if v_head_dim is None else v_head_dim
    if mode == "none" or rank is None:
        return head_dim + v
    rk = rank if mode in ("keys", "kv") else head_dim
    rv = rank if mode in ("values", "kv") else v
    return rk + rv + (rk + rv) % 2


# Common accelerators, memory as nvidia-smi reports it (MiB): the KV cache alone
# must fit (weights and activations not counted).
ACCELERATORS: dict[str, int] = {
    "24 GB (RTX 4090 / L4-class)": 24564 * 2**20,
    "80 GB (A100 / H100)": 81559 * 2**20,
    "141 GB (H200)": 143771 * 2**20,
}


class ManagedLayers:
    """Indices of the managed layers, held as ranges (a model may have 10**20 layers):
    len() is arithmetic; iteration and JSON list them only when there are few."""

    LISTED = 4096

    def __init__(self, ranges: list[range], excluded: frozenset[int], count: int) -> None:
        self._ranges, self._excluded, self._count = ranges, excluded, count

    @property
    def count(self) -> int:
        return self._count

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(i for r in self._ranges for i in r if i not in self._excluded))

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, ManagedLayers)) else NotImplemented

    def to_json(self) -> list[int] | str:
        if self._count <= self.LISTED:
            return list(self)
        return f"{self._count} layers: all managed-kind layers not in full_layers"


@dataclass
class FlashEstimate:
    """Device-resident and cold-tier bytes under a FlashMemoryConfig (whole batch)."""

    device_resident_bytes: int
    cold_bytes: int
    cold_codec: str
    tiers: dict[str, int]
    managed_layers: ManagedLayers
    full_layers: list[int]
    tier_counts: dict[str, int]  # per managed layer, per sequence (token-equivalents)
    fits: dict[str, bool] = field(default_factory=dict)  # device bytes (the prompt peak) vs accelerators
    cold_layout: str = "exact"  # "exact" or the cold_low_rank layout, e.g. "kv r=32"
    cold_bytes_per_token: float = 0.0  # cold-tier bytes per sealed token, one sequence, all managed layers
    # An exact prompt (prefill_exact_tokens) with a lossy cold tier: its K/V, held on the device
    # until the first generated token, for min(tokens, cap) tokens of the managed layers, whole
    # batch (0 when the prompt is streamed from an exact cold tier)
    prompt_kv_bytes: int = 0

    @property
    def prompt_peak_bytes(self) -> int:
        """Device bytes while an exact prompt runs, at most: the tiers plus the prompt's K/V."""
        return self.device_resident_bytes + self.prompt_kv_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_resident_bytes": self.device_resident_bytes,
            "prompt_kv_bytes": self.prompt_kv_bytes,
            "prompt_peak_bytes": self.prompt_peak_bytes,
            "cold_bytes": self.cold_bytes,
            "cold_codec": self.cold_codec,
            "cold_layout": self.cold_layout,
            "cold_bytes_per_token": self.cold_bytes_per_token,
            "tiers": dict(self.tiers),
            "managed_layers": self.managed_layers.to_json(),
            "full_layers": list(self.full_layers),
            "tier_counts_per_layer": dict(self.tier_counts),
            "fits": dict(self.fits),
        }


@dataclass
class Estimate:
    model: str
    source: str
    layers: int
    layer_summary: str
    dtype: str
    element_bytes: int
    tokens: int
    batch: int
    bytes_per_token: int | float  # growth per token at long context, one sequence
    fixed_bytes: int  # bounded part (sliding windows), one sequence, at long context
    full_cache_bytes: int  # whole batch, exact at `tokens`
    per_kind_bytes: dict[str, int]
    fits: dict[str, bool]
    flashmem: FlashEstimate | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model": self.model,
            "source": self.source,
            "layers": self.layers,
            "layer_summary": self.layer_summary,
            "dtype": self.dtype,
            "element_bytes": self.element_bytes,
            "tokens": self.tokens,
            "batch": self.batch,
            "bytes_per_token": self.bytes_per_token,
            "fixed_bytes": self.fixed_bytes,
            "full_cache_bytes": self.full_cache_bytes,
            "full_cache_gb": self.full_cache_bytes / 1e9,
            "full_cache_gib": self.full_cache_bytes / 2**30,
            "per_kind_bytes": dict(self.per_kind_bytes),
            "fits": dict(self.fits),
        }
        if self.flashmem is not None:
            d["flashmem"] = self.flashmem.to_dict()
        return d


def _num(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def estimate(
    model: Any = None,
    *,
    tokens: int | str,
    batch: int = 1,
    dtype: str | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    config: FlashMemoryConfig | str | Path | None = None,
) -> Estimate:
    """Estimate the KV cache of `model` after `tokens` tokens for `batch` sequences.

    `model`: a built-in name (see `flashmem.sizing.specs.BUILTIN_MODELS`), an HF
    folder with config.json, a .gguf file, a transformers config object, or a
    `ModelSpec`; or give `layers`, `kv_heads`, `head_dim` (and `dtype`) instead.
    `tokens`: an int or a string like '131072', '128K', '1M' (K/M binary).
    `config`: a FlashMemoryConfig (or YAML path) for the device/cold split.
    """
    spec = _spec(model, layers, kv_heads, head_dim, dtype)
    n_tokens = parse_tokens(tokens)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ConfigError(f"--batch: {batch!r} is not allowed; allowed: an integer >= 1")
    dname = normalize_dtype(dtype if dtype is not None else spec.dtype)
    eb = DTYPE_BYTES[dname]

    per_kind: dict[str, int] = {}
    per_token = Fraction(0)
    fixed = 0
    total = 0
    for layer, where in spec.layer_positions():  # arithmetic per layer kind, not per layer
        n = _count(where)
        b = layer.cache_bytes(n_tokens, eb) * n
        per_kind[layer.kind] = per_kind.get(layer.kind, 0) + b * batch
        per_token += layer.bytes_per_token(eb) * n
        fixed += layer.fixed_bytes(eb) * n
        total += b
    full = total * batch

    cfg = _load_config(config)
    flash = _flash_split(spec, cfg, n_tokens, batch, eb) if cfg is not None else None
    if flash is not None:
        flash.fits = _fits(flash.prompt_peak_bytes)  # the device must hold the prompt's peak too
    return Estimate(
        model=spec.name,
        source=spec.source,
        layers=spec.num_layers,
        layer_summary=spec.summary(),
        dtype=dname,
        element_bytes=eb,
        tokens=n_tokens,
        batch=batch,
        bytes_per_token=_num(per_token),
        fixed_bytes=fixed,
        full_cache_bytes=full,
        per_kind_bytes=per_kind,
        fits=_fits(full),
        flashmem=flash,
    )


def _count(r: range) -> int:
    """len(r) without len(): a range of more than 2**63 layers is still counted."""
    return max(0, (r.stop - r.start + r.step - 1) // r.step)


def _fits(nbytes: int) -> dict[str, bool]:
    return {name: nbytes <= cap for name, cap in ACCELERATORS.items()}


def _spec(model: Any, layers: Any, kv_heads: Any, head_dim: Any, dtype: str | None) -> ModelSpec:
    dims = {"--layers": layers, "--kv-heads": kv_heads, "--head-dim": head_dim}
    given = [k for k, v in dims.items() if v is not None]
    if model is not None:
        if given:
            raise ConfigError(
                f"{given[0]}: not allowed together with --model; allowed: either --model "
                "or --layers, --kv-heads and --head-dim"
            )
        return resolve_model(model)
    missing = [k for k, v in dims.items() if v is None]
    if missing:
        raise ConfigError(
            f"missing {', '.join(missing)}; allowed: --model NAME|FOLDER|FILE.gguf, or all of "
            "--layers, --kv-heads, --head-dim (and --dtype)"
        )
    return from_dims(layers, kv_heads, head_dim, dtype=normalize_dtype(dtype or "bfloat16"))


def _load_config(config: Any) -> FlashMemoryConfig | None:
    if config is None or isinstance(config, FlashMemoryConfig):
        return config
    if isinstance(config, (str, Path)):
        return FlashMemoryConfig.from_yaml(config)
    if isinstance(config, dict):
        return FlashMemoryConfig.from_dict(config)
    raise ConfigError(f"--config: {config!r} is not allowed; allowed: a YAML file path")


def _cold_layout(cfg: FlashMemoryConfig) -> str:
    return "exact" if cfg.cold_low_rank == "none" else f"{cfg.cold_low_rank} r={cfg.low_rank_dim}"


def _add_device_tiers(
    tiers: dict[str, int], cfg: FlashMemoryConfig, counts: TierCounts, layer: FullAttention | MLA, n: int, eb: int
) -> None:
    """Add to `tiers` the device-resident bytes of `n` managed layers of one kind."""
    entry = layer.entry_elems() * eb  # one token-equivalent, K and V (or latent)
    tiers["sinks"] += counts.sinks * entry * n
    tiers["window"] += counts.window * entry * n
    tiers["open_block"] += counts.open_block * entry * n
    tiers["csa_entries"] += counts.csa_entries * entry * n
    tiers["hca_entries"] += counts.hca_entries * entry * n
    heads, width = layer.index_heads()  # width: a cached row, which an int8 working set scales once
    ws_scale = working_set_scale(cfg, width, eb)
    # pages kept past the selection (lsa_cache_pages) are held as the working set is, and counted in it
    tiers["working_set"] += int(round((counts.working_set + counts.page_cache) * entry * n * ws_scale))
    tiers["index"] += heads * index_bytes(cfg, counts, width, eb) * n  # type: ignore[assignment]


def _cold_elements(cfg: FlashMemoryConfig, layer: FullAttention | MLA) -> int:
    """Elements one token of a managed layer keeps in the cold tier (K and V, or low-rank coefficients)."""
    if not (isinstance(layer, FullAttention) and cfg.cold_low_rank != "none"):
        return layer.entry_elems()
    per_head = cold_elements_per_token(cfg.cold_low_rank, cfg.low_rank_dim, layer.head_dim, layer.v_head_dim)
    if cfg.cold_codec != "exact":
        # int8/int4 code the second slot per token in groups of CODE_GROUP: a coefficient
        # row narrower than a group is padded to it (r=16 costs what r=32 does there)
        w = per_head // 2
        per_head = w + -(-w // CODE_GROUP) * CODE_GROUP
    return layer.kv_heads * per_head


def _flash_split(spec: ModelSpec, cfg: FlashMemoryConfig, tokens: int, batch: int, eb: int) -> FlashEstimate:
    cfg.check_for_model(spec.num_layers)
    full_idx = cfg.resolve_full_layers(spec.num_layers)
    counts = tier_counts(cfg, tokens)
    cold_eb = codec_bytes_per_element(cfg.cold_codec, eb)
    tiers = tier_names.zeros()  # the same rows a cache's memory_report() measures
    cold = Fraction(0)
    cold_per_token = Fraction(0)  # one sequence, every managed layer
    prompt_kv = 0
    # an exact prompt is streamed from the tiers when the cold tier is exact (nothing held); a
    # lossy cold tier keeps the prompt's K/V on the device until the first generated token
    held = cfg.cold_codec != "exact" or cfg.cold_low_rank != "none"
    prompt_tokens = min(tokens, cfg.prefill_exact_tokens) if held else 0
    managed: list[range] = []
    n_managed = 0
    for layer, where in spec.layer_positions():  # arithmetic per layer kind, not per layer
        b = layer.cache_bytes(tokens, eb)
        if not layer.managed:
            key = "sliding_layers" if layer.kind == "sliding" else "native_compressed_layers"
            tiers[key] += b * _count(where)
            continue
        n_full = sum(1 for i in full_idx if i in where)
        tiers["full_layers"] += b * n_full
        n = _count(where) - n_full
        if n == 0:
            continue
        managed.append(where)
        n_managed += n
        assert isinstance(layer, FullAttention | MLA)  # the managed kinds
        entry = layer.entry_elems() * eb  # one token-equivalent, K and V (or latent)
        prompt_kv += prompt_tokens * entry * n
        _add_device_tiers(tiers, cfg, counts, layer, n, eb)
        cold_elems = _cold_elements(cfg, layer)
        cold_per_token += Fraction(cold_elems) * Fraction(cold_eb) * n
        cold += Fraction(counts.cold_tokens * cold_elems) * Fraction(cold_eb) * n
    tiers = {k: v * batch for k, v in tiers.items()}
    return FlashEstimate(
        device_resident_bytes=sum(tiers.values()),
        cold_bytes=int(round(cold * batch)),
        cold_codec=cfg.cold_codec,
        cold_layout=_cold_layout(cfg),
        cold_bytes_per_token=float(cold_per_token),
        tiers=tiers,
        managed_layers=ManagedLayers(managed, full_idx, n_managed),
        full_layers=sorted(full_idx),
        tier_counts=counts.as_dict(),
        prompt_kv_bytes=prompt_kv * batch,
    )
