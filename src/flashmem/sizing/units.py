"""Units of the memory calculator: token counts, element sizes, byte sizes.

Conventions (also in `flashmem estimate --help`):

* token counts: a plain integer is exact (``1000000`` is one million tokens);
  a ``K`` / ``M`` / ``G`` suffix is binary: K = 2**10, M = 2**20, G = 2**30
  (``128K`` = 131072, ``1M`` = 1048576).
* byte sizes are printed both ways: GB = 10**9 bytes and GiB = 2**30 bytes.
"""

from __future__ import annotations

import re

from flashmem.errors import ConfigError

TOKEN_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_TOKENS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)\s*$", re.IGNORECASE)
_TOKENS_HELP = (
    "an integer like 131072 (exact), or with a binary suffix K = 1024, M = 1048576, " "G = 2**30, like 128K or 1M"
)


def parse_tokens(text: str | int, flag: str = "--tokens") -> int:
    """`131072`, `128K`, `1M`, `1.5M` -> token count (K/M/G are binary)."""
    if isinstance(text, bool):
        raise ConfigError(f"{flag}: {text!r} is not a token count; allowed: {_TOKENS_HELP}")
    if isinstance(text, int):
        value = text
    else:
        cleaned = str(text).replace("_", "").replace(",", "")
        m = _TOKENS_RE.match(cleaned)
        if not m:
            raise ConfigError(f"{flag}: {str(text)!r} is not a token count; allowed: {_TOKENS_HELP}")
        number, suffix = m.group(1), m.group(2).upper()
        mult = TOKEN_SUFFIX[suffix]
        if "." in number:
            whole, frac = number.split(".")
            scaled = int(whole + frac) * mult
            div = 10 ** len(frac)
            if scaled % div:
                raise ConfigError(f"{flag}: {str(text)!r} is not a whole number of tokens; allowed: {_TOKENS_HELP}")
            value = scaled // div
        else:
            value = int(number) * mult
    if value < 1:
        raise ConfigError(f"{flag}: {text!r} is not allowed; allowed: at least 1 token")
    return value


# bytes per element of a cached K/V tensor
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8": 1,
    "int8": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp8": "float8",
    "f8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "fp8_e4m3": "float8",
    "torch.float8_e4m3fn": "float8",
    "q8_0": "int8",
}


def normalize_dtype(dtype: object, flag: str = "--dtype") -> str:
    """A dtype name (or torch.dtype) -> canonical name in DTYPE_BYTES."""
    name = str(dtype).strip().lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        import difflib

        choices = sorted(set(DTYPE_BYTES) | set(_DTYPE_ALIASES) - {k for k in _DTYPE_ALIASES if "." in k})
        near = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(
            f"{flag}: {str(dtype)!r} is not a known dtype; {hint}allowed: "
            + ", ".join(sorted(DTYPE_BYTES))
            + " (or fp32, fp16, bf16, fp8)"
        )
    return name


def dtype_bytes(dtype: object) -> int:
    return DTYPE_BYTES[normalize_dtype(dtype)]


def fmt_bytes(n: float) -> str:
    """`1998848000000` -> '1.999 TB (1.818 TiB)': decimal and binary side by side."""
    n = float(n)
    dec = _scaled(n, 1000, ["B", "kB", "MB", "GB", "TB", "PB"])
    if n < 1024:
        return dec
    return f"{dec} ({_scaled(n, 1024, ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'])})"


def _scaled(n: float, base: int, names: list[str]) -> str:
    i = 0
    while abs(n) >= base and i < len(names) - 1:
        n /= base
        i += 1
    if i == 0:
        return f"{int(n)} {names[0]}"
    return f"{n:.3f} {names[i]}"


def gib(n: float) -> float:
    return n / 2**30
