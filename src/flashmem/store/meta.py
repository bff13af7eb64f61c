"""meta.json of an on-disk store folder: written atomically, validated on reopen.

A reopened folder's metadata decides how every payload is decoded, so each
field is checked against what this version allows; anything else is a
one-line ColdStoreError naming the field (never a guess, never rewritten).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch

from flashmem.errors import ColdStoreError
from flashmem.store.codecs import CODECS, DTYPE_CODES, Codec, get_codec
from flashmem.store.disk_io import store_error
from flashmem.store.private_fs import open_private, open_read

META_NAME = "meta.json"
MAX_META_BYTES = 64 * 1024
DTYPES = {str(d).removeprefix("torch."): d for d in DTYPE_CODES}


def write_meta(folder: str, fmt: int, codec: str, dtype: torch.dtype, persist: bool, **extra: Any) -> None:
    meta = {
        "format": fmt,
        "codec": codec,
        "dtype": str(dtype).removeprefix("torch."),
        "persist": persist,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        **extra,
    }
    tmp = os.path.join(folder, META_NAME + ".tmp")
    try:
        os.unlink(tmp)  # a leftover (or a planted link): removed, its target untouched
    except FileNotFoundError:
        pass
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, META_NAME))


def read_meta(folder: str, formats: tuple[int, ...]) -> tuple[dict[str, Any], Codec, torch.dtype]:
    """(meta, codec, dtype) of a store folder; ColdStoreError naming the bad field."""
    path = os.path.join(folder, META_NAME)
    try:
        fd = open_read(path)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
    except OSError as exc:
        raise store_error(folder, "not a readable flashmem store folder", exc) from None
    bad = f"cold store {folder}: {META_NAME} is damaged"
    if len(raw) > MAX_META_BYTES:
        raise ColdStoreError(f"{bad}: larger than {MAX_META_BYTES} bytes")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ColdStoreError(f"{bad}: not JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise ColdStoreError(f"{bad}: top level is {type(meta).__name__}; allowed: an object")
    if meta.get("format") not in formats:
        raise ColdStoreError(f"{bad}: format {meta.get('format')!r}; allowed: {', '.join(map(str, formats))}")
    if meta.get("codec") not in CODECS:
        raise ColdStoreError(f"{bad}: codec {meta.get('codec')!r}; allowed: {', '.join(CODECS)}")
    if meta.get("dtype") not in DTYPES:
        raise ColdStoreError(f"{bad}: dtype {meta.get('dtype')!r}; allowed: {', '.join(DTYPES)}")
    if not isinstance(meta.get("persist", False), bool):
        raise ColdStoreError(f"{bad}: persist {meta.get('persist')!r}; allowed: true or false")
    return meta, get_codec(meta["codec"]), DTYPES[meta["dtype"]]
