"""`flashmem calibrate`: fit the index's low-rank keys and learned indexer from a model's own attention.

    cal = flashmem.calibrate(model, tokenizer, text="pydoc", tokens=4096, out="calib/")
    cfg = FlashMemoryConfig(lsa_scorer="learned", calibration="calib/")

The model runs over calibration text (never the text a benchmark evaluates on)
in sequences of `seq_tokens`; per calibrated layer (every layer that is not
sliding-window) and KV head, `fit.fit_layer` fits the PCA key basis and the
trained dual encoder, and `fit.fit_cold_bases` the full-rank pre-RoPE key and
value bases of the low-rank cold tier (`cold_low_rank`). Saved as safetensors +
a JSON manifest (`artifact`).
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from pathlib import Path
from typing import Any

import torch

from flashmem.calibration.artifact import FORMAT, Calibration, load_calibration, model_fingerprint
from flashmem.calibration.capture import Captured, capture_qk
from flashmem.calibration.fit import fit_cold_bases, fit_layer
from flashmem.calibration.texts import attention_layers, token_sequences

__all__ = ["Calibration", "cached_calibration", "calibrate", "default_folder", "load_calibration", "model_fingerprint"]


# What `attach(..., tokenizer=tok)` builds when no calibration is cached: `calibrate`'s
# defaults (a few minutes on a 2-core CPU for SmolLM2 / Gemma3-270m).
AUTO_SETTINGS: dict[str, Any] = {}


def default_folder(model: Any) -> Path:
    """Where `flashmem calibrate` keeps a model's default calibration and `attach` looks
    for it: `calibrations/<model fingerprint>` under the model cache
    (`$FLASHMEM_CACHE_DIR` or `~/.cache/flashmem/models`)."""
    from flashmem.models.registry import cache_root

    return cache_root() / "calibrations" / model_fingerprint(model)


def cached_calibration(model: Any, tokenizer: Any = None) -> Calibration:
    """This model's default calibration: read from `default_folder(model)`, or built
    there once (with the defaults of `calibrate`) when a tokenizer is given."""
    folder = default_folder(model)
    if (folder / "manifest.json").is_file():
        cal = load_calibration(folder)
        cal.check_model(model)
        return cal
    if tokenizer is None:
        from flashmem.errors import ConfigError

        raise ConfigError(
            f"calibration: none cached for this model at {folder}; allowed: run `flashmem calibrate --model M` "
            "once, pass tokenizer= to flashmem.attach to build it, or set `calibration:` to a folder"
        )
    return calibrate(model, tokenizer, out=folder, **AUTO_SETTINGS)


def calibrate(
    model: Any,
    tokenizer: Any,
    *,
    text: str = "pydoc",
    tokens: int = 4096,
    seq_tokens: int = 2048,
    rank: int = 16,
    page_tokens: int = 16,
    window: int = 64,
    sinks: int = 4,
    steps: int = 150,
    layers: list[int] | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Calibration:
    """Fit the calibration of `model` on `tokens` tokens of `text` (a built-in name or a file)."""
    t0 = time.perf_counter()
    cfg = model.config.get_text_config(decoder=True)
    if layers is None:
        layers = attention_layers(cfg)
    seq_tokens = min(seq_tokens, tokens)
    n_seq = max(1, tokens // seq_tokens)
    sequences, source = token_sequences(tokenizer, text, n_seq, seq_tokens)
    bar = _bar(progress, n_seq + len(layers))
    cap = _capture(model, layers, sequences, bar)
    from flashmem.models import geometry

    kinds_all = geometry.layer_types(cfg, cfg.num_hidden_layers, infer_sliding=False)
    tensors: dict[str, torch.Tensor] = {}
    kl: dict[str, list[float]] = {}
    fit = {"rank": rank, "page_tokens": page_tokens, "window": window, "sinks": sinks, "steps": steps}
    for i in layers:
        layer_tensors, kl[str(i)] = _fit_one_layer(model, cap, i, kinds_all[i], **fit)
        tensors.update(layer_tensors)
        bar.update(1)
    bar.close()
    manifest = _manifest(model, cfg, source, n_seq * seq_tokens, seq_tokens, fit, layers, tensors, kl, t0)
    cal = Calibration(manifest, tensors)
    if out is not None:
        cal.save(Path(out))
    return cal


def _manifest(
    model: Any,
    cfg: Any,
    source: str,
    tokens: int,
    seq_tokens: int,
    fit: dict[str, int],
    layers: list[int],
    tensors: dict[str, torch.Tensor],
    kl: dict[str, list[float]],
    t0: float,
) -> dict[str, Any]:
    """What a calibration was fitted from and with (saved as manifest.json).

    fit: `calibrate`'s rank, page_tokens, window, sinks and steps; t0: when the fit began."""
    rank, sinks = fit["rank"], fit["sinks"]
    return {
        "format": FORMAT,
        "model": getattr(model.config, "name_or_path", "") or cfg.model_type,
        "model_fingerprint": model_fingerprint(model),
        "text": source,
        "tokens": tokens,
        "seq_tokens": seq_tokens,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "rank": min(rank, int(tensors[f"layer.{layers[0]}.key_basis"].shape[-1])) if layers else rank,
        "page_tokens": fit["page_tokens"],
        "window": fit["window"],
        "sinks": sinks,
        "steps": fit["steps"],
        "layers": layers,
        "indexer_kl": kl,
        # cold-tier bases (format 2): full rank, fitted without each sequence's first `sinks` tokens
        "cold_bases": {"ranks": "1..head_dim", "skip_tokens": sinks, "keys": "pre-RoPE, pca and attention-weighted"},
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _capture(model: Any, layers: list[int], sequences: list[list[int]], bar: Any) -> Captured:
    """Queries, keys and values of `layers` over the calibration `sequences` (one forward each)."""
    device = next(model.parameters()).device
    with capture_qk(model, set(layers)) as cap, torch.no_grad():
        for chunk in sequences:
            model(input_ids=torch.tensor([chunk], device=device), use_cache=False)
            bar.update(1)
    return cap


def _fit_one_layer(
    model: Any, cap: Captured, i: int, kind: str | None, *, rank: int, page_tokens: int, window: int, sinks: int,
    steps: int,
) -> tuple[dict[str, torch.Tensor], list[float]]:  # fmt: skip
    """Layer `i`'s cold bases and indexer as named tensors, and the indexer's training KL."""
    from flashmem.rope import find_rotator

    tensors: dict[str, torch.Tensor] = {}
    d = cap.keys[i][0].shape[-1]
    rot = find_rotator(model, kind, d)
    # Keys are un-rotated with the layer's own RoPE; without one only the values get a basis.
    unrot = rot.unrotate if rot is not None else (lambda x, pos: x)
    cold = fit_cold_bases(cap.keys[i], cap.values[i], unrot, skip=sinks, queries=cap.queries[i])
    if rot is not None:
        tensors[f"layer.{i}.key_basis_pre"] = cold.key_basis_pre
        tensors[f"layer.{i}.key_energy_pre"] = cold.key_energy_pre
        assert cold.key_enc_pre is not None and cold.key_dec_pre is not None
        tensors[f"layer.{i}.key_enc_pre"] = cold.key_enc_pre
        tensors[f"layer.{i}.key_dec_pre"] = cold.key_dec_pre
    tensors[f"layer.{i}.value_basis"] = cold.value_basis
    tensors[f"layer.{i}.value_energy"] = cold.value_energy
    fit = fit_layer(
        cap.queries[i],
        cap.keys[i],
        cap.scaling[i],
        rank=rank,
        page=page_tokens,
        window=window,
        sinks=sinks,
        steps=steps,
    )
    tensors[f"layer.{i}.key_basis"] = fit.key_basis
    tensors[f"layer.{i}.query_proj"] = fit.query_proj
    tensors[f"layer.{i}.key_proj"] = fit.key_proj
    return tensors, fit.train_kl


class _NoBar:
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


def _bar(on: bool, total: int) -> Any:
    if not on:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is in the bench extra; the bar is optional
        return _NoBar()
    return tqdm(total=total, desc="calibrate", unit="step")
