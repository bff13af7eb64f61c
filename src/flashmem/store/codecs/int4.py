"""int4 codec: KIVI groups of 32, 4-bit codes packed two per byte. 0.5 + 4/32 bytes per element."""

from __future__ import annotations

from flashmem.store.codecs.quantized import QuantCodec


class Int4Codec(QuantCodec):
    name = "int4"
    code = 2
    bits = 4
