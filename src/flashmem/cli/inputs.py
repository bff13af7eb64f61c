"""Checks of CLI inputs and outputs, made before any work starts.

An output path that cannot be written is found before a run of minutes, not
after it; inputs are read through `flashmem.user_files` (regular files only,
capped); result files are checked for the shape `flashmem report` needs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flashmem.errors import FlashMemError
from flashmem.models.weight_layout import LAYOUTS
from flashmem.user_files import MiB, read_user_text

MAX_INPUT_BYTES = 256 * MiB  # --input text: far beyond any context the models take
MAX_RESULTS_BYTES = 256 * MiB


def check_output_path(path: Path | None, flag: str) -> None:
    """FlashMemError unless `path` can be created or replaced as a file."""
    if path is None:
        return
    if path.is_dir():
        raise FlashMemError(f"{flag} {path}: is a folder; allowed: a file path (e.g. {path / 'out.json'})")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FlashMemError(f"{flag} {path}: folder {parent} does not exist; allowed: a file in an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise FlashMemError(f"{flag} {path}: not writable; allowed: a file path you can write")


# --dtype: the floating types a model loads in (flashmem.load_model)
DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(name: str) -> Any:
    """The `--dtype` value as a torch dtype; a one-line FlashMemError naming the allowed ones otherwise."""
    import torch

    if name not in DTYPES:
        raise FlashMemError(f"--dtype {name!r}: allowed: {', '.join(DTYPES)}")
    return getattr(torch, name)


# --weight-layout: how the linear weights lie in memory, or auto (flashmem.models.weight_layout)
WEIGHT_LAYOUTS = ("auto", *LAYOUTS)


def check_weight_layout(name: str) -> str:
    """The `--weight-layout` value; a one-line FlashMemError naming the allowed ones otherwise."""
    if name not in WEIGHT_LAYOUTS:
        raise FlashMemError(f"--weight-layout {name!r}: allowed: {', '.join(WEIGHT_LAYOUTS)}")
    return name


def read_input_text(path: Path) -> str:
    return read_user_text(path, "--input", MAX_INPUT_BYTES)


def check_results_file(path: Path) -> None:
    """FlashMemError unless `path` (when it exists) is a `flashmem bench` JSON: an object
    with a list of row objects under "rows" (and "meta", an object, if present)."""
    if not path.exists():
        return  # load_rows says so, or reads the partial rows of an interrupted run
    text = read_user_text(path, "results file", MAX_RESULTS_BYTES)
    what = f"results file {path}: not a `flashmem bench` JSON"
    try:
        doc: Any = json.loads(text)
    except ValueError as exc:
        raise FlashMemError(f"{what} ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise FlashMemError(f"{what}; allowed: an object with a list 'rows' (and 'meta')")
    if not all(isinstance(r, dict) for r in doc["rows"]) or not isinstance(doc.get("meta", {}), dict):
        raise FlashMemError(f"{what}; allowed: 'rows' a list of objects, 'meta' an object")
