"""Helpers shared by the scripts under benchmarks/ (and benchmarks/diagnostics/).

They used to live in the scripts themselves and were imported script to script
through `sys.path`; here they are public functions of `flashmem_eval`, which
`pip install -e .` puts on the path:

- `tiny_llama_long`: the random 4-layer Llama of the long-context benchmarks;
- `drop_file` / `drop_segments` / `raw_sequential`: the disk helpers of the
  cold-tier benchmarks (page cache dropped, raw sequential bandwidth);
- `probe` / `late_probe` / `score` / `LATE_FORMATS`: needle prompts in formats
  the retrieval suite does not use (the held-out checks of
  `benchmarks/page_retrieval.py`);
- `needle_pages`: the index pages holding a needle's answer;
- `median_ms` / `cpu_name`: a call's median time, and the CPU a timing ran on (timings
  compare only within one machine).
"""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from flashmem.texts import haystack, insert_needles
from flashmem_eval.suites import make_probe, score_answer
from flashmem_eval.tiny import build_llama

__all__ = [
    "LATE_FORMATS",
    "cpu_name",
    "drop_file",
    "drop_segments",
    "late_probe",
    "median_ms",
    "needle_pages",
    "probe",
    "pydoc_text",
    "raw_sequential",
    "score",
    "tiny_llama_long",
]


def tiny_llama_long(tokens: int) -> Any:
    """A random-weight Llama for `tokens` of context: 4 layers, 4 KV heads x 64 dims, fp32
    (8 KiB of K/V per token, 256 KiB per 128-token block), vocabulary 1024."""
    return build_llama(
        0,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=tokens + 4096,
    )


# ---- disk


def drop_file(path: str) -> None:
    """Write back and evict one file from the page cache (fsync + fadvise DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_segments(folder: str) -> None:
    """Evict a store's data files (disk segments, LMDB's data.mdb), so the next reads come
    from the device. Pages an open LMDB environment has touched stay mapped and resident:
    reopen it after dropping to measure it cold."""
    for name in os.listdir(folder):
        if name.startswith("seg-") or name == "data.mdb":
            drop_file(os.path.join(folder, name))


def raw_sequential(folder: str, nbytes: int, chunk: int = 4 * 2**20) -> float:
    """Bytes/s reading a fresh file of about `nbytes` front to back after dropping its page cache."""
    path = os.path.join(folder, f"raw-{os.getpid()}.bin")
    buf = os.urandom(chunk)
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // chunk)):
            f.write(buf)
    drop_file(path)
    fd = os.open(path, os.O_RDONLY)
    out = bytearray(chunk)
    t0 = time.perf_counter()
    off = 0
    while (n := os.preadv(fd, [out], off)) > 0:
        off += n
    dt = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    return off / dt


# ---- needle prompts beyond the retrieval suite's formats


def pydoc_text() -> str:
    """The Python reference's topic texts (`pydoc_data.topics`), joined: a haystack."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


# Formats added after the recipe was chosen (2026-12-01), never used to pick it: other
# answer types (a word, a code of letters and digits, a date), an inline needle, the
# question before the text, and the New Testament / stdlib docstrings as haystacks.
LATE_FORMATS = ("word_nt", "code_stdlib", "date_pydoc", "qfirst_kjv")
_WORDS = ["cardamom", "saffron", "tamarind", "fennel", "juniper", "sumac", "anise", "sorrel"]
_MONTHS = ["January", "March", "April", "June", "August", "October", "November"]


def probe(tok: Any, fmt: str, length: int, depth: float, seed: int, salt: str = "") -> tuple[str, str, str]:
    """(context, question, answer) of about `length` tokens: `passkey` / `multikey` as the
    retrieval suite makes them, `locker_kjv` / `locker_pydoc` (a locker code in the KJV text
    or the Python reference), or one of LATE_FORMATS. `salt` varies the random draws."""
    if fmt in ("passkey", "multikey"):
        p = make_probe(tok, fmt, length, depth, seed)
        return p.context, p.question, p.answer
    rng = random.Random(f"{fmt}{seed}{depth}{salt}")
    if fmt in LATE_FORMATS:
        return late_probe(tok, fmt, length, depth, rng)
    name = rng.choice(["Maria", "Tomas", "Ingrid", "Kwame", "Yuki"])
    code = str(rng.randint(100000, 999999))
    needle = f"Note from the archivist: the locker code assigned to {name} is {code}."
    question = (
        f"\n\nQuestion: what is the locker code assigned to {name}? Answer: the locker code assigned to {name} is"
    )
    if fmt == "locker_pydoc":
        text = pydoc_text()
        start = rng.randrange(0, len(text) - length * 6)
        ids = tok(text[start : start + length * 5], add_special_tokens=False)["input_ids"][: length - 80]
        hay = tok.decode(ids)
    else:
        hay = haystack(tok, length - 80, seed=rng.randrange(10**6))
    return insert_needles(hay, [(needle, depth)], own_paragraph=True), question, code


def late_probe(tok: Any, fmt: str, length: int, depth: float, rng: random.Random) -> tuple[str, str, str]:
    """(context, question, answer) of a LATE_FORMATS prompt of about `length` tokens."""
    lead = ""
    if fmt == "word_nt":
        answer = rng.choice(_WORDS)
        needle = f"And the gardener said that the secret ingredient of the harvest soup was {answer}."
        question = "\n\nWhat was the secret ingredient of the harvest soup? The secret ingredient was"
        hay_name, own = "kjv-nt", False
    elif fmt == "code_stdlib":
        letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
        answer = f"{rng.choice(letters)}{rng.choice(letters)}{rng.randint(10, 99)}-{rng.randint(100, 999)}"
        needle = f"(Maintenance note: the vault of the east archive opens with the combination {answer}.)"
        question = "\n\nQuestion: which combination opens the vault of the east archive? Answer: the combination is"
        hay_name, own = "stdlib-doc", True
    elif fmt == "date_pydoc":
        name = rng.choice(["Heron", "Basalt", "Lumen", "Quarry", "Tundra"])
        answer = f"{rng.randint(2, 28)} {rng.choice(_MONTHS)}"
        needle = f"The committee finally scheduled the launch of Project {name} for {answer} {rng.randint(2031, 2049)}."
        question = f"\n\nOn what date is the launch of Project {name} scheduled? It is scheduled for"
        hay_name, own = "pydoc", True
    else:  # qfirst_kjv: the question comes before the text, only a short cue after it
        answer = str(rng.randint(100000, 999999))
        lead = "Read the text below, then report the serial number stamped on the brass lantern.\n\n"
        needle = f"The brass lantern had the serial number {answer} stamped on its base."
        question = "\n\nThe serial number stamped on the brass lantern is"
        hay_name, own = "kjv", True
    n = length - 80 - len(tok(lead, add_special_tokens=False)["input_ids"])
    if hay_name == "pydoc":
        text = pydoc_text()
        start = rng.randrange(0, len(text) - n * 6)
        hay = tok.decode(tok(text[start : start + n * 5], add_special_tokens=False)["input_ids"][:n])
    else:
        hay = haystack(tok, n, seed=rng.randrange(10**6), name=hay_name)
    return lead + insert_needles(hay, [(needle, depth)], own_paragraph=own), question, answer


def score(output: str, answer: str) -> bool:
    """A number: the output's first number is it; otherwise the output contains it as whole
    words, any case ("5 March" is not in "15 March")."""
    if answer.isdigit():
        return score_answer(output, answer)
    return re.search(rf"(?<!\w){re.escape(answer.lower())}(?!\w)", output.lower()) is not None


def needle_pages(tok: Any, context: str, answer: str, sinks: int, page: int) -> list[int]:
    """Index pages (counted after the sinks) holding the first token of each occurrence of `answer`."""
    enc = tok(context, add_special_tokens=True, return_offsets_mapping=True)
    spans = [m.start() for m in re.finditer(re.escape(answer), context)]
    starts = [min(i for i, (_, b) in enumerate(enc["offset_mapping"]) if b > c) for c in spans]
    return sorted({(i - sinks) // page for i in starts if i >= sinks})


def median_ms(fn: Callable[[], Any], reps: int, warm: int = 1) -> float:
    """The median milliseconds of `reps` calls of fn (synchronous: a CPU's), after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""
