"""int8 codec: KIVI groups of 32, 8-bit codes. 1 + 4/32 bytes per element."""

from __future__ import annotations

from flashmem.store.codecs.quantized import QuantCodec


class Int8Codec(QuantCodec):
    name = "int8"
    code = 1
    bits = 8
