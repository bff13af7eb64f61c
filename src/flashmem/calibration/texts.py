"""Calibration texts: a built-in name or a file.

`pydoc` (the default) is the Python language and library reference topics that
ship with CPython (`pydoc_data.topics`, about 0.46 MB of English technical
prose, PSF licence): always installed, and not a text the benchmarks evaluate
on (they use the King James text and the stdlib docstrings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashmem.errors import ConfigError

MAX_FILE_BYTES = 64 * 2**20
NAMES = ("pydoc",)


def calibration_text(text: str) -> tuple[str, str]:
    """(the text, a description for the manifest)."""
    if text == "pydoc":
        import pydoc_data.topics as topics

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)), "pydoc (pydoc_data.topics)"
    path = Path(text)
    if not path.is_file():
        raise ConfigError(
            f"calibration text: {text!r} is neither a built-in text nor a file; allowed: {', '.join(NAMES)} or a text file"
        )
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ConfigError(
            f"calibration text: {text} is larger than {MAX_FILE_BYTES >> 20} MiB; allowed: a smaller text file"
        )
    try:
        return path.read_text(encoding="utf-8"), f"file {path.name}"
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"calibration text: {text} cannot be read as UTF-8 ({type(exc).__name__})") from None


def token_sequences(tokenizer: Any, text: str, n_seq: int, seq_tokens: int) -> tuple[list[list[int]], str]:
    """`n_seq` sequences of `seq_tokens` token ids from the calibration text `text` (the
    tokenizer's BOS first when it has one), and the text's description."""
    body, source = calibration_text(text)
    # Tokenize only what is needed (English BPE: well under 12 characters a token).
    ids = tokenizer(body[: 12 * n_seq * seq_tokens + 4096], add_special_tokens=False)["input_ids"]
    if len(ids) < n_seq * seq_tokens:
        raise ConfigError(
            f"calibration text {text!r}: {len(ids)} tokens, fewer than the {n_seq * seq_tokens} asked for; "
            "allowed: --tokens up to the text's length, or a longer --text FILE"
        )
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    return [bos + ids[s * seq_tokens : (s + 1) * seq_tokens - len(bos)] for s in range(n_seq)], source


def attention_layers(cfg: Any) -> list[int]:
    """Layers of a text config that attend over the whole history (not sliding or chunked):
    the ones a calibration or a layer profile measures."""
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return [i for i, k in enumerate(kinds) if k not in ("sliding_attention", "chunked_attention")]
