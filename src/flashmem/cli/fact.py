"""The main job's question: a fact planted far back in the long text, asked at the end.

`flashmem run --text kjv` plants one sentence ("the access code for the north
gate is 417302") at a chosen depth of the context and appends a question about
it, so the answer needs a token thousands of positions back: what the cache
must keep findable. The full cache's answer is printed beside flashmem's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from flashmem.errors import FlashMemError
from flashmem.texts import insert_needles

PLACES = ("north gate", "chapel safe", "harbour office", "east tower", "grain store")


@dataclass
class PlantedFact:
    ids: list[int]  # context with the fact, then the question: `context_tokens` tokens in all
    fact: str
    question: str
    answer: str
    fact_token: int  # index of the fact's first token in `ids`


def plant_fact(tok: Any, source: str, context_tokens: int | None, depth: float, seed: int = 0) -> PlantedFact:
    """The last `context_tokens` tokens of `source` with a fact at `depth` (0 = start) and a question at the end."""
    if not 0.0 <= depth <= 1.0:
        raise FlashMemError(f"--fact-depth: {depth} is not allowed; allowed: 0 to 1")
    rng = random.Random(seed)
    place, code = rng.choice(PLACES), str(rng.randint(100000, 999999))
    fact = f"Note from the keeper: the access code for the {place} is {code}."
    question = f"\n\nQuestion: what is the access code for the {place}? Answer: the access code for the {place} is"
    q_ids = tok(question, add_special_tokens=False).input_ids
    fact_len = len(tok(" " + fact, add_special_tokens=False).input_ids) + 4  # paragraph breaks
    special = len(tok("", add_special_tokens=True).input_ids)  # a BOS the tokenizer may add
    if context_tokens is not None:
        # a little more text than fits, cut to the exact length after re-tokenising
        room = context_tokens - len(q_ids) - fact_len - special + 16
        if room < 32:
            raise FlashMemError(f"--context-tokens: {context_tokens} leaves no room for the text; allowed: >= 200")
        source = tok.decode(tok(source[-room * 8 :], add_special_tokens=False).input_ids[-room:])
    text = insert_needles(source, [(fact, depth)], own_paragraph=True)
    at = text.index(fact)
    ids = tok(text, add_special_tokens=True).input_ids
    fact_token = len(tok(text[:at], add_special_tokens=True).input_ids)
    if context_tokens is not None and len(ids) + len(q_ids) > context_tokens:
        cut = len(ids) + len(q_ids) - context_tokens  # from the front, after the BOS
        ids, fact_token = ids[:special] + ids[special + cut :], fact_token - cut
    return PlantedFact(ids + q_ids, fact, question.strip(), code, max(0, fact_token))


def found(text: str, answer: str) -> bool:
    """The answer's digits come first in the generated text (what a reader would accept)."""
    digits = "".join(ch if ch.isdigit() else " " for ch in text).split()
    return bool(digits) and digits[0] == answer
