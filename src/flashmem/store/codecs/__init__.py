"""Cold-tier codecs by name: exact, int8, int4 (see memory/tiers.codec_bytes_per_element)."""

from __future__ import annotations

from flashmem.store.codecs.base import DTYPE_CODES, DTYPES_BY_CODE, Codec
from flashmem.store.codecs.exact import ExactCodec
from flashmem.store.codecs.int4 import Int4Codec
from flashmem.store.codecs.int8 import Int8Codec

CODECS: dict[str, Codec] = {c.name: c for c in (ExactCodec(), Int8Codec(), Int4Codec())}
CODECS_BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"cold_codec: {name!r} is not allowed; allowed: {', '.join(CODECS)}") from None


__all__ = ["CODECS", "CODECS_BY_CODE", "DTYPE_CODES", "DTYPES_BY_CODE", "Codec", "get_codec"]
