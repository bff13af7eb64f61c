"""Calibration texts: a built-in name or a file.

`pydoc` (the default) is the Python language and library reference topics that
ship with CPython (`pydoc_data.topics`, about 0.46 MB of English technical
prose, PSF licence): always installed, and not a text the benchmarks evaluate
on (they use the King James text and the stdlib docstrings).
"""

from __future__ import annotations

from pathlib import Path

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
