"""How far each layer attends: the share of attention beyond the sinks and the recent window.

A layer whose queries put most of their mass on the first tokens and the last
few dozen needs few selected pages; a layer that reads far back needs many. On
SmolLM2-135M at 8K the 20 sinks and the last 112 tokens hold 19% of layer 7's
attention and 93-97% of six other layers', and with the same total of pages a
split by the far share answers needles an even split misses
(docs/measurements.md, "Pages per layer by how far it attends").

The profile is measured once per model on calibration text (`texts`, never a
benchmark's haystack) with the model's own full attention and cached as JSON
next to the model's calibrations; `layer_shares` turns it into
`lsa_layer_shares`, which `attach` fills in for a config that says `profile`
(the recipe of `FlashMemoryConfig.for_budget` does).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flashmem import progress
from flashmem.calibration.artifact import model_fingerprint
from flashmem.calibration.capture import capture_qk
from flashmem.calibration.texts import attention_layers, token_sequences

if TYPE_CHECKING:
    from flashmem.config import FlashMemoryConfig

FORMAT = 1
# Window sizes (tokens) the far share is measured for; a config's window is read off between them.
WINDOWS = (16, 32, 64, 128, 256, 512)
SINKS = 20  # the recipe's sink tokens: attention to them is never missing
QUERY_STRIDE = 8  # sampled queries: every 8th of each sequence's second half


# model -> the tokenizer flashmem.load_model returned with it, so attach can measure a
# missing profile without being handed one.
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# model -> its profile once read or measured: a server attaches a cache per sequence, and
# the fingerprint hashes weights, so each model's file is read once.
_PROFILES: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def remember_tokenizer(model: Any, tokenizer: Any) -> None:
    _TOKENIZERS[model] = tokenizer


def known_tokenizer(model: Any) -> Any:
    try:
        return _TOKENIZERS.get(model)
    except TypeError:  # not weak-referenceable
        return None


def profile_path(model: Any) -> Path:
    """`layer_profiles/<fingerprint>.json` under the model cache."""
    from flashmem.models.registry import cache_root

    return cache_root() / "layer_profiles" / f"{model_fingerprint(model)}.json"


@torch.no_grad()
def measure_layer_profile(
    model: Any, tokenizer: Any, *, text: str = "pydoc", tokens: int = 4096, seq_tokens: int = 2048
) -> dict[str, Any]:
    """Per full-attention layer and window size W: the mean attention mass (over query
    heads and sampled queries in each sequence's second half) outside the first SINKS
    tokens and the last W -> {"far": {layer: [share per WINDOWS]}, ...manifest}."""
    t0 = time.perf_counter()
    layers = attention_layers(model.config.get_text_config(decoder=True))
    n_seq = max(1, tokens // seq_tokens)
    sequences, source = token_sequences(tokenizer, text, n_seq, seq_tokens)
    device = next(model.parameters()).device
    far: dict[int, list[list[float]]] = {i: [] for i in layers}
    # a minute or more on a busy CPU: progress per decoder layer of each sequence
    with progress.step(
        "layer profile (measured once per model)", total=len(sequences) * seq_tokens, unit="tokens"
    ) as shown:
        for chunk in sequences:
            with capture_qk(model, set(layers), keep_values=False) as cap, progress.forward_tokens(model, shown):
                model(input_ids=torch.tensor([chunk], device=device), use_cache=False)
            for i in layers:
                far[i].append(far_shares(cap.queries[i][0], cap.keys[i][0], cap.scaling[i]))
    return {
        "format": FORMAT,
        "model_fingerprint": model_fingerprint(model),
        "text": source,
        "tokens": n_seq * seq_tokens,
        "sinks": SINKS,
        "windows": list(WINDOWS),
        "far": {str(i): [sum(v) / len(v) for v in zip(*far[i])] for i in layers},
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def far_shares(q: torch.Tensor, k: torch.Tensor, scaling: float) -> list[float]:
    """q [Hq, T, d], k [Hkv, T, d] (post-RoPE) -> per WINDOWS entry, the mean causal
    attention mass of the sampled queries outside the sinks and the last W keys."""
    hq, t, _ = q.shape
    group = hq // k.shape[0]
    pos = torch.arange(t // 2, t, QUERY_STRIDE)
    kk = k.repeat_interleave(group, 0)  # [Hq, T, d]
    logits = (q[:, pos] @ kk.transpose(1, 2)) * scaling  # [Hq, nq, T]
    keys = torch.arange(t)
    logits = logits.masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
    p = torch.softmax(logits.float(), -1)
    dist = pos[:, None] - keys[None, :]  # [nq, T] distance back from the query
    out = []
    for w in WINDOWS:
        far = (dist >= w) & (keys[None, :] >= SINKS)
        out.append(float((p * far[None]).sum(-1).mean()))
    return out


def cached_layer_profile(model: Any, tokenizer: Any = None) -> dict[str, Any] | None:
    """This model's profile from the cache, or measured and cached when a tokenizer is
    given (seconds on CPU for SmolLM2); None when neither."""
    try:
        known = _PROFILES.get(model)
    except TypeError:  # not weak-referenceable
        known = None
    if known is not None:
        return known
    path = profile_path(model)
    prof = None
    if path.is_file():
        try:
            prof = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            prof = None  # unreadable: measured again below
        if prof is not None and (prof.get("format") != FORMAT or prof.get("model_fingerprint") != path.stem):
            prof = None
    if prof is None:
        if tokenizer is None:
            return None
        prof = measure_layer_profile(model, tokenizer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(prof, indent=1), encoding="utf-8")
        tmp.replace(path)
    try:
        _PROFILES[model] = prof
    except TypeError:
        pass
    return prof


def layer_shares(profile: dict[str, Any], window: int, floor: float = 0.05) -> dict[int, float]:
    """Relative pages per layer when the last `window` tokens are always attended: each
    layer's far share (interpolated between the measured windows), plus `floor` times
    the mean share so no layer is left without pages; mean 1."""
    windows = [float(w) for w in profile["windows"]]
    far = {int(i): _interpolate(windows, [float(x) for x in v], float(window)) for i, v in profile["far"].items()}
    if not far:
        return {}
    mean = sum(far.values()) / len(far)
    if mean <= 0:
        return {i: 1.0 for i in far}
    raw = {i: v + floor * mean for i, v in far.items()}
    scale = len(raw) / sum(raw.values())
    return {i: round(v * scale, 4) for i, v in raw.items()}


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs ascending), flat beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def attended_window(cfg: FlashMemoryConfig) -> int:
    """Recent tokens a step always attends exactly: the window plus, on average, half
    an open block."""
    return int(cfg.gpu_cache_limit + cfg.hca_chunk_size // 2)


def resolve_profile_shares(cfg: FlashMemoryConfig, model: Any, tokenizer: Any = None) -> FlashMemoryConfig:
    """`cfg` with `lsa_layer_shares: profile` replaced by the model's shares at the
    config's window (None, an even split, with a warning, when there is no profile and
    no tokenizer to measure one)."""
    prof = cached_layer_profile(model, tokenizer if tokenizer is not None else known_tokenizer(model))
    if prof is None:
        warnings.warn(
            "lsa_layer_shares: profile: no layer profile cached for this model and no tokenizer to measure "
            "one, so every layer selects lsa_top_k pages; pass tokenizer= to flashmem.attach",
            stacklevel=3,
        )
        return cfg.model_copy(update={"lsa_layer_shares": None})
    w = cfg.lsa_layer_profile_weight
    shares = {i: round(1 - w + w * v, 4) for i, v in layer_shares(prof, attended_window(cfg)).items()}
    return cfg.model_copy(update={"lsa_layer_shares": shares})
