"""Cold-tier codecs, registered in `flashmem.policies.CODECS` (which declares
each codec's bytes per element for the calculator)."""

from __future__ import annotations

from flashmem import policies
from flashmem.store.codecs.base import DTYPE_CODES, DTYPES_BY_CODE, Codec

CODECS: dict[str, Codec] = {name: policies.load(c.impl)() for name, c in policies.CODECS.items()}
CODECS_BY_CODE: dict[int, Codec] = {c.code: c for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    return policies.lookup(CODECS, "cold_codec", name)


__all__ = ["CODECS", "CODECS_BY_CODE", "DTYPE_CODES", "DTYPES_BY_CODE", "Codec", "get_codec"]
